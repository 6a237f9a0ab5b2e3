//! `cargo xtask demo` and `cargo xtask up`: the stack binary of `tests/e2e`, after
//! installing and building what it runs (real vLLM too, for `--engine vllm`).

use std::process::Command;

use crate::{sh, vllm};

fn stack(args: &[&str]) -> anyhow::Result<()> {
    sh::prepare_stack()?;
    if args.windows(2).any(|w| w == ["--engine", "vllm"]) {
        vllm::ensure_newest()?;
    }
    sh::run(Command::new(sh::root().join("target/debug/stack")).args(args))
}

/// Two replicas, kvaffined and Envoy; a two-turn conversation; where each turn went.
pub fn run(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["demo"];
    all.extend_from_slice(args);
    stack(&all)
}

/// The stack in the foreground until SIGINT or SIGTERM.
pub fn up(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["up"];
    all.extend_from_slice(args);
    stack(&all)
}
