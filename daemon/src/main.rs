//! `kvaffined`: kvaffine's out-of-band index daemon, and the operator's key tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvaffined::{check_cmd, config, keys_cmd, serve};

/// Command line of `kvaffined`.
#[derive(Parser)]
#[command(name = "kvaffined", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print vLLM's block keys for a JSON array of token ids read on stdin.
    ///
    /// The tool to answer "why does this prefix not match": compare its output with the
    /// hashes in a replica's KV events.
    Keys(keys_cmd::KeysArgs),
    /// Follow replicas' KV events and answer lookups.
    Serve(Box<config::ServeArgs>),
    /// Check one vLLM replica's settings: can kvaffine compute its keys?
    Check(check_cmd::CheckArgs),
}

/// Exit code for input a command cannot use (the same code clap uses for bad flags).
const EXIT_BAD_INPUT: u8 = 2;
/// Exit code when `serve` cannot start or stops on an error.
const EXIT_FAILURE: u8 = 1;

fn serve(args: config::ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve::run(args))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (result, failure) = match cli.command {
        Command::Keys(args) => (
            keys_cmd::run(&args, std::io::stdin().lock(), std::io::stdout().lock()),
            EXIT_BAD_INPUT,
        ),
        Command::Serve(args) => (serve(*args), EXIT_FAILURE),
        Command::Check(args) => (check_cmd::run(&args), EXIT_BAD_INPUT),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvaffined: {err:#}");
            ExitCode::from(failure)
        }
    }
}
