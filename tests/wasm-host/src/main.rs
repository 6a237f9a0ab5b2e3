//! `kong-host`: the compiled filter behind a small Kong-like gateway on loopback.
//!
//! Prints `listening on ADDR` once it serves. The filter's metrics are at
//! `GET /_wasm_host/metrics` (JSON), its log at `GET /_wasm_host/logs`, and the number of
//! streams open at `GET /_wasm_host/streams`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvaffine_wasm_host::gateway::{self, GatewayConfig, KONG_DEFAULT_BODY_BUFFER};
use kvaffine_wasm_host::vm::Vm;

/// Runs a proxy-wasm filter as Kong would, in front of a service's targets.
#[derive(Parser)]
struct Args {
    /// The filter module.
    #[arg(long)]
    wasm: PathBuf,
    /// The filter's configuration (JSON text), as Kong passes a filter's `config`.
    #[arg(long)]
    config: String,
    /// Filter name (Kong's filter entry; also the metrics prefix `pw.<name>.`).
    #[arg(long, default_value = "kvaffine")]
    name: String,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// A target of the service (`host:port`); repeat for several, balanced round robin
    /// when the filter pins nothing.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// `nginx_http_client_body_buffer_size` in bytes (Kong's default is 8k).
    #[arg(long, default_value_t = KONG_DEFAULT_BODY_BUFFER)]
    client_body_buffer_size: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let vm = Vm::load(&args.wasm, &args.name, args.config.as_bytes())
        .context("cannot start the filter")?;
    let (listener, addr) = gateway::bind(args.listen).await?;
    println!("listening on {addr}");
    gateway::serve(
        listener,
        vm,
        GatewayConfig {
            targets: args.targets,
            body_buffer: args.client_body_buffer_size,
        },
    )
    .await
}
