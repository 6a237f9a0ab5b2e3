//! `cargo xtask demo` and `cargo xtask up`: the stack binary of `tests/e2e`, after
//! installing and building what it runs.

use std::process::Command;

use crate::sh;

fn stack(args: &[&str]) -> anyhow::Result<()> {
    sh::prepare_stack()?;
    sh::run(Command::new(sh::root().join("target/debug/stack")).args(args))
}

/// Two replicas, kvaffined and Envoy; a two-turn conversation; where each turn went.
pub fn run() -> anyhow::Result<()> {
    stack(&["demo"])
}

/// The stack in the foreground until SIGINT or SIGTERM.
pub fn up(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["up"];
    all.extend_from_slice(args);
    stack(&all)
}
