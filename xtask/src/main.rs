//! `cargo xtask`: the project's one front door. Every command installs what it needs
//! itself, so a fresh machine needs nothing but the Rust toolchain.

mod bench;
mod compat;
mod demo;
mod docs;
mod npm;
mod sh;
mod vllm;

use anyhow::{Context, bail};

const USAGE: &str = "usage: cargo xtask <command>

commands:
  demo [--engine emu|vllm]
                two replicas, kvaffined and Envoy: a two-turn conversation, where each turn went
                (emu: vllm-emu, the default; vllm: real vLLM, installed on first use)
  up [--replicas N] [--gateway-port P] [--engine emu|vllm]
                the same stack in the foreground (gateway on 127.0.0.1:P, default 8080)
  up --upstream HOST:PORT [--upstream HOST:PORT ...] [--block-size N] [--gateway-port P]
     [--prefill-tokens-per-second N]
                kvaffined and Envoy in front of vLLM replicas you already run
  test          every check CI runs: fmt, clippy (native and wasm32), all tests (real vLLM:
                the newest pinned version, and an older one on the routing subset), deploy/
                validation, the docs site
  compat [--version V ...]
                the real-vLLM suite against every pinned vLLM version -> docs/compat.md
  docs          regenerate the reference pages, build the book into target/book
  npm           vLLM's block keys for JavaScript -> target/npm/kvaffine-keys-<version>.tgz
                (and the console's copy of its browser build, daemon/ui/keys/)
  bench core    key, token-scan and event-decode throughput -> docs/benchmarks/core.md
  bench daemon  index lookups, HTTP lookups, ingest, memory -> docs/benchmarks/daemon.md
  bench scale   the index and lookups at 8, 64 and 1,024 endpoints beside the 64-slot index,
                1,024 real event streams, scenarios through 1, 2 and 4 gateways with their
                daemons peered or not -> docs/benchmarks/scale.md
  bench filter [--engine emu|vllm]
                latency and CPU the filter adds in Envoy -> docs/benchmarks/filter.md
                (real vLLM replicas and their /tokenize: docs/benchmarks/filter-vllm.md)
  bench filter-profile
                where precise mode's pause goes on the emulator: the filter's histograms,
                the callouts timed directly, its work natively -> docs/benchmarks/filter-profile.md
  bench restart
                a gateway's kvaffined restarted between a fresh prefix's first request and
                its siblings, peered or not -> docs/benchmarks/restart.md
  bench outcomes
                the filter's cost with report_outcomes on and off -> docs/benchmarks/outcomes.md
  bench precise-cost
                what precise routing adds to a continuation on real vLLM against its own
                /tokenize, and where the filter's time goes -> docs/benchmarks/precise-cost.md
  bench prefill-shape
                real vLLM's prefill time by prompt length and cached prefix, beside the
                ranking's cost model -> docs/benchmarks/prefill-shape.md
  bench seed [--engine emu|vllm] [--model hybrid]
                the published two-replica measurement, reproduced -> docs/benchmarks/seed/
                (real vLLM: docs/benchmarks/seed-vllm/; GPT-OSS's hybrid attention: -hybrid)
  bench scenarios [--engine emu|vllm] [--model hybrid|large] | --time-scale X
                eight production scenarios x routing profiles -> docs/benchmarks/README.md
                (real vLLM, beside the emulator at the same shapes: docs/benchmarks/scenarios-vllm/;
                GPT-OSS's hybrid attention: docs/benchmarks/scenarios-hybrid/, scenarios-vllm-hybrid/;
                real vLLM's larger model and a mixed fleet: docs/benchmarks/scenarios-vllm-large/;
                the emulator at another speed: docs/benchmarks/scenarios-time-scale-X/)
  bench peers [--engine emu|vllm [--model large] [--runs N]] | --time-scale X [--runs N]
                vllm-router and sglang-router side by side with kvaffine -> docs/benchmarks/peers.md
                (real vLLM: docs/benchmarks/peers-vllm/, its larger model: peers-vllm-large/;
                the emulator at another speed: docs/benchmarks/peers-time-scale-X/;
                --runs N, N odd: every workload N times, tables of the medians)
  bench peers-overhead
                what each router adds per request, three runs -> docs/benchmarks/peers-overhead.md
  bench reliability
                faults, 60 s of load, ingest under lookups -> docs/reliability.md
  bench soak [--minutes N] [--engine emu|vllm]
                steady traffic (default 30 minutes), every bounded structure sampled
                -> docs/benchmarks/soak/ (real vLLM: docs/benchmarks/soak-vllm/) and
                the soak section of docs/reliability.md
  vectors       the Responses conversion vectors, from the newest pinned vLLM's own code
                -> tests/vllm/vectors/responses.json
  fuzz TARGET SECONDS
                libFuzzer on a core/fuzz target (decode_batch, frames, plan)";

fn main() -> std::process::ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // What failed and why, on one line: a failed step is not a crash, so no
        // backtrace even where RUST_BACKTRACE is set.
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> anyhow::Result<()> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["demo", rest @ ..] => demo::run(rest),
        ["up", rest @ ..] => demo::up(rest),
        ["test"] => test(),
        ["compat", rest @ ..] => compat::run(rest),
        ["docs"] => docs::build(),
        ["npm"] => npm::run(),
        ["bench", "core"] => bench::core(),
        ["bench", "daemon"] => bench::daemon(),
        ["bench", "scale"] => bench::scale(),
        ["bench", "filter", rest @ ..] => bench::filter(rest),
        ["bench", "filter-profile"] => bench::filter_profile(),
        ["bench", "outcomes"] => bench::outcomes(),
        ["bench", "restart"] => bench::restart(),
        ["bench", "precise-cost"] => bench::precise_cost(),
        ["bench", "prefill-shape"] => bench::prefill_shape(),
        ["bench", "seed", rest @ ..] => bench::seed(rest),
        ["bench", "reliability"] => bench::reliability(),
        ["bench", "soak", rest @ ..] => bench::soak(rest),
        ["bench", "peers-overhead"] => bench::peers_overhead(),
        ["bench", "peers", rest @ ..] => bench::peers(rest),
        ["bench", "scenarios", rest @ ..] => bench::scenarios(rest),
        ["vectors"] => vectors(),
        ["fuzz", target, seconds] => fuzz(target, seconds),
        ["help" | "--help" | "-h"] | [] => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}

/// Writes the Responses-to-chat vectors with the newest pinned vLLM's own conversion.
fn vectors() -> anyhow::Result<()> {
    let venv = vllm::ensure(&vllm::newest()?)?;
    let output = std::process::Command::new(venv.join("bin/python"))
        .arg(sh::root().join("tests/vllm/responses_vectors.py"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cannot run tests/vllm/responses_vectors.py")?;
    if !output.status.success() {
        bail!("tests/vllm/responses_vectors.py failed: {}", output.status);
    }
    let path = sh::root().join("tests/vllm/vectors/responses.json");
    std::fs::write(&path, &output.stdout)
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("{}", path.display());
    Ok(())
}

/// Runs a libFuzzer target of `core/fuzz` for `seconds`. cargo-fuzz needs nightly flags;
/// `RUSTC_BOOTSTRAP` lets the stable toolchain accept them for this run only.
fn fuzz(target: &str, seconds: &str) -> anyhow::Result<()> {
    let seconds: u64 = seconds
        .parse()
        .map_err(|_| anyhow::anyhow!("SECONDS must be a number"))?;
    let installed = std::process::Command::new(sh::cargo_bin())
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        sh::cargo(&["install", "--locked", "cargo-fuzz"])?;
    }
    sh::run(
        std::process::Command::new(sh::cargo_bin())
            .args([
                "fuzz",
                "run",
                target,
                "--",
                &format!("-max_total_time={seconds}"),
                "-max_len=4096",
            ])
            .current_dir(sh::root().join("core/fuzz"))
            .env("RUSTC_BOOTSTRAP", "1"),
    )
}

/// Runs one phase of `test`, printing how long it took.
fn phase(name: &str, work: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let result = work();
    eprintln!(
        "xtask test: {name}: {:.1} s{}",
        started.elapsed().as_secs_f64(),
        if result.is_ok() { "" } else { " (failed)" }
    );
    result
}

/// Everything CI checks, in the order that fails fastest.
fn test() -> anyhow::Result<()> {
    phase("toolchain, fmt", || {
        sh::ensure_lint_components()?;
        sh::cargo(&["fmt", "--all", "--", "--check"])?;
        sh::ensure_wasm_target()?;
        sh::ensure_debian_tools()?;
        sh::ensure_python_tools()
    })?;
    phase("clippy (native and wasm32)", || {
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
        ])
    })?;
    // End-to-end suites start the workspace's binaries, Envoy and the filter for real.
    phase("build the filter and binaries", || {
        sh::build_filter()?;
        sh::cargo(&["build", "--workspace", "--bins"])
    })?;
    // Every manifest rendered and schema-checked, every Envoy config through Envoy's own
    // validation, with the filter just built.
    phase("deploy/ validation, docs", || {
        sh::run(
            std::process::Command::new("bash")
                .arg(sh::root().join("deploy/validate.sh"))
                .env(
                    "KVAFFINE_WASM",
                    sh::root().join("target/wasm32-wasip1/wasm/kvaffine_filter.wasm"),
                ),
        )?;
        docs::check()
    })?;
    // The real-vLLM suite needs its venvs and model; installed once, then cached.
    phase("real vLLM install", || {
        vllm::ensure_newest()?;
        vllm::ensure(vllm::CI_OLDER).map(drop)
    })?;
    let mut counts = (0, 0);
    phase("kvaffine-keys (npm package, under Node)", || {
        counts = npm::test()?;
        Ok(())
    })?;
    phase("cargo test --workspace", || {
        let (passed, failed) = sh::cargo_test(&["test", "--workspace"], &[])?;
        counts = (counts.0 + passed, counts.1 + failed);
        Ok(())
    })?;
    phase(
        &format!("real vLLM {} (routing subset)", vllm::CI_OLDER),
        || {
            let (passed, failed) = sh::cargo_test(
                &["test", "-p", "kvaffine-e2e", "--test", "real_vllm"],
                &[
                    ("KVAFFINE_VLLM_VERSION", vllm::CI_OLDER),
                    ("KVAFFINE_VLLM_CHECKS", "routing"),
                ],
            )?;
            counts = (counts.0 + passed, counts.1 + failed);
            Ok(())
        },
    )?;
    // The plain closing line CI reads, summed over every test binary above.
    println!("xtask test: {} passed, {} failed", counts.0, counts.1);
    Ok(())
}
