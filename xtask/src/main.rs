//! `cargo xtask`: the project's one front door. Every command installs what it needs
//! itself, so a fresh machine needs nothing but the Rust toolchain.

mod bench;
mod demo;
mod sh;

use anyhow::bail;

const USAGE: &str = "usage: cargo xtask <command>

commands:
  demo          two replicas, kvaffined and Envoy: a two-turn conversation, where each turn went
  up [--replicas N] [--gateway-port P]
                the same stack in the foreground (gateway on 127.0.0.1:P, default 8080)
  test          every check CI runs: fmt, clippy (native and wasm32), all tests
  bench core    key and event-decode throughput -> docs/benchmarks/core.md
  bench daemon  index lookups, HTTP lookups, ingest, memory -> docs/benchmarks/daemon.md
  bench filter  latency and CPU the filter adds in Envoy -> docs/benchmarks/filter.md
  bench seed    the published two-replica measurement, reproduced -> docs/benchmarks/seed/";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["demo"] => demo::run(),
        ["up", rest @ ..] => demo::up(rest),
        ["test"] => test(),
        ["bench", "core"] => bench::core(),
        ["bench", "daemon"] => bench::daemon(),
        ["bench", "filter"] => bench::filter(),
        ["bench", "seed"] => bench::seed(),
        ["help" | "--help" | "-h"] | [] => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}

/// Everything CI checks, in the order that fails fastest.
fn test() -> anyhow::Result<()> {
    sh::ensure_wasm_target()?;
    sh::ensure_lint_components()?;
    sh::ensure_envoy()?;
    sh::cargo(&["fmt", "--all", "--", "--check"])?;
    sh::cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    // The core must build unchanged for the filter's target.
    sh::cargo(&[
        "clippy",
        "-p",
        "kvaffine-core",
        "-p",
        "kvaffine-wasm-kernel",
        "-p",
        "kvaffine-filter",
        "--target",
        sh::WASM_TARGET,
        "--",
        "-D",
        "warnings",
    ])?;
    // End-to-end suites start the workspace's binaries, Envoy and the filter for real.
    sh::build_filter()?;
    sh::cargo(&["build", "--workspace", "--bins"])?;
    let (passed, failed) = sh::cargo_test(&["test", "--workspace"])?;
    // The plain closing line CI reads, summed over every test binary above.
    println!("xtask test: {passed} passed, {failed} failed");
    Ok(())
}
