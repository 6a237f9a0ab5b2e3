//! `kvaffined`: kvaffine's out-of-band index daemon, and the operator's key tool.

mod keys_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
}

/// Exit code for input a command cannot use (the same code clap uses for bad flags).
const EXIT_BAD_INPUT: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Keys(args) => {
            keys_cmd::run(&args, std::io::stdin().lock(), std::io::stdout().lock())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvaffined: {err:#}");
            ExitCode::from(EXIT_BAD_INPUT)
        }
    }
}
