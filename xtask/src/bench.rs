//! `cargo xtask bench ...`: runs a benchmark and writes its figures, with the command that
//! made them and the machine they were made on, into `docs/benchmarks/`.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use serde_json::Value;

use crate::sh;

/// Median time of one criterion benchmark iteration, in nanoseconds.
fn median_ns(id: &str) -> anyhow::Result<f64> {
    let path = sh::root()
        .join("target/criterion")
        .join(id)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("no criterion estimates at {}", path.display()))?;
    let estimates: Value = serde_json::from_str(&text)?;
    estimates["median"]["point_estimate"]
        .as_f64()
        .context("estimates without a median")
}

fn command_output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The CPU, core count, toolchain and time of a measurement, for its page.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!(
        "{cpu}, {} cores; {}; {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        command_output("rustc", &["--version"]),
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
    )
}

/// Keys and the tokenizer answer's scan natively and in wasm, and event decoding ->
/// `docs/benchmarks/core.md`.
pub fn core() -> anyhow::Result<()> {
    sh::ensure_wasm_target()?;
    sh::cargo(&[
        "build",
        "--release",
        "-p",
        "kvaffine-wasm-kernel",
        "--target",
        sh::WASM_TARGET,
    ])?;
    let kernel = sh::root().join("target/wasm32-wasip1/release/kvaffine_wasm_kernel.wasm");
    sh::run(
        Command::new(sh::cargo_bin())
            .args(["bench", "-p", "kvaffine-core-bench", "--bench", "core"])
            .env("KVAFFINE_WASM_KERNEL", &kernel),
    )?;
    const TOKENS: f64 = 8192.0;
    const ENTRIES: f64 = 128.0;
    let native = TOKENS / median_ns("keys/native")? * 1e3;
    let wasm = TOKENS / median_ns("keys/wasm")? * 1e3;
    let decode = ENTRIES / median_ns("decode/block_entries")? * 1e3;
    let (scan_native_ns, scan_wasm_ns, scan_serde_ns) = (
        median_ns("scan/native")?,
        median_ns("scan/wasm")?,
        median_ns("scan/native_serde")?,
    );
    let scan_native = TOKENS / scan_native_ns * 1e3;
    let scan_wasm = TOKENS / scan_wasm_ns * 1e3;
    let scan_serde = TOKENS / scan_serde_ns * 1e3;
    let native_hash_share = median_ns("keys/native_sha256_only")? / median_ns("keys/native")?;
    let wasm_hash_share = median_ns("keys/wasm_sha256_only")? / median_ns("keys/wasm")?;
    let mut md = String::new();
    writeln!(md, "# Core throughput\n")?;
    writeln!(
        md,
        "Command: `cargo xtask bench core` (criterion medians; one run, one process, so the native/wasm ratio is side by side)."
    )?;
    writeln!(md, "Machine: {}.\n", machine())?;
    writeln!(md, "| what | median | aim |")?;
    writeln!(md, "|---|---|---|")?;
    writeln!(
        md,
        "| block keys, native (sha256_cbor, 64-token blocks, 8,192-token prompt) | {native:.1} M tokens/s | >= 100 M tokens/s |"
    )?;
    writeln!(
        md,
        "| block keys, wasm32-wasip1 under wasmtime (Cranelift) | {wasm:.1} M tokens/s | >= 30 M tokens/s |"
    )?;
    writeln!(
        md,
        "| token list read from an 8,192-token `/tokenize` answer, native | {scan_native:.1} M tokens/s | |"
    )?;
    writeln!(
        md,
        "| the same, wasm32-wasip1 under wasmtime (Cranelift) | {scan_wasm:.1} M tokens/s | |"
    )?;
    writeln!(
        md,
        "| the same answer read by serde into a typed list, native | {scan_serde:.1} M tokens/s | |"
    )?;
    writeln!(
        md,
        "| KV-event decode (map layout, 32 BlockStored x 4 blocks, 64 tokens each) | {decode:.2} M block entries/s | >= 2 M block entries/s |"
    )?;
    writeln!(
        md,
        "\nKeys, wasm / native: {:.2}. One 8,192-token prompt costs {:.0} us native, {:.0} us in wasm.\n",
        wasm / native,
        median_ns("keys/native")? / 1e3,
        median_ns("keys/wasm")? / 1e3
    )?;
    writeln!(
        md,
        "SHA-256 alone over same-sized preimages takes {:.0}% of the keying time natively ({:.0} us: the same hash over the same buffers in every run, a yardstick of the machine's speed that day) and {:.0}% in wasm (`keys/*_sha256_only`).\n",
        native_hash_share * 100.0,
        median_ns("keys/native_sha256_only")? / 1e3,
        wasm_hash_share * 100.0
    )?;
    writeln!(
        md,
        "Reading the token list of that prompt's `/tokenize` answer costs {:.0} us native, {:.0} us in wasm (wasm / native {:.2}, where the keys' is {:.2}); serde reading it into a typed list natively, {:.0} us ({:.2}x the scan in wasm).\n",
        scan_native_ns / 1e3,
        scan_wasm_ns / 1e3,
        scan_wasm / scan_native,
        wasm / native,
        scan_serde_ns / 1e3,
        scan_serde_ns / scan_wasm_ns
    )?;
    md.push_str(include_str!("bench_core_notes.md"));
    let out = sh::root().join("docs/benchmarks/core.md");
    write(&out, &md)?;
    println!("{md}");
    Ok(())
}

/// Index lookups, HTTP lookups, ingest and memory -> `docs/benchmarks/daemon.md`.
pub fn daemon() -> anyhow::Result<()> {
    daemon_bench(
        "daemon",
        "Daemon speed and size",
        "Index: 1 M blocks as chains of 128 keys over 8 endpoints; lookups of 128 keys.",
        "",
        include_str!("bench_daemon_notes.md"),
    )
}

/// The index and lookups at 8, 64 and 1,024 endpoints beside the 64-slot index, ingest
/// from many endpoints, the daemon binary following 1,024 real event streams, and
/// scenarios through several gateways, their daemons peered or not ->
/// `docs/benchmarks/scale.md`.
pub fn scale() -> anyhow::Result<()> {
    let streams = e2e_bench(&["streams", "1024"])?;
    let gateways = stack_bench(&["gateways"])?;
    daemon_bench(
        "scale",
        "The daemon at fleet scale",
        "Index: 1 M blocks as chains of 128 keys, each held by 1 or 8 of the endpoints; \
         lookups of 128 keys (a whole chain).",
        &format!("{streams}\n\n{gateways}"),
        include_str!("bench_scale_notes.md"),
    )
}

/// Runs kvaffined's bench `name` and writes its tables, then `more` tables, then `notes`,
/// to `docs/benchmarks/{name}.md`.
fn daemon_bench(
    name: &str,
    title: &str,
    setup: &str,
    more: &str,
    notes: &str,
) -> anyhow::Result<()> {
    let output = Command::new(sh::cargo_bin())
        .args(["bench", "-p", "kvaffined", "--bench", name])
        .current_dir(sh::root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run the {name} bench"))?;
    if !output.status.success() {
        anyhow::bail!("the {name} bench failed: {}", output.status);
    }
    let table = String::from_utf8_lossy(&output.stdout);
    let mut md = String::new();
    writeln!(md, "# {title}\n")?;
    writeln!(
        md,
        "Command: `cargo xtask bench {name}` (release build; every operation timed, percentiles over all of them)."
    )?;
    writeln!(md, "Machine: {}.\n", machine())?;
    writeln!(md, "{setup}\n")?;
    md.push_str(table.trim());
    md.push_str("\n\n");
    if !more.trim().is_empty() {
        md.push_str(more.trim());
        md.push_str("\n\n");
    }
    md.push_str(notes);
    write(&sh::root().join(format!("docs/benchmarks/{name}.md")), &md)?;
    println!("{md}");
    Ok(())
}

/// The real-vLLM benchmark model of a run (`--model`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum BenchModel {
    /// [`crate::vllm::BENCH`].
    Bench,
    /// `--model hybrid`: [`crate::vllm::BENCH_HYBRID`].
    Hybrid,
    /// `--model large`: [`crate::vllm::BENCH_LARGE`] (and a mixed fleet beside
    /// [`crate::vllm::BENCH`]).
    Large,
}

impl BenchModel {
    /// The bench binary's trailing argument for it.
    fn arg(self) -> Option<&'static str> {
        match self {
            Self::Bench => None,
            Self::Hybrid => Some("hybrid"),
            Self::Large => Some("large"),
        }
    }

    /// What its pages' directory names end with.
    fn suffix(self) -> &'static str {
        match self {
            Self::Bench => "",
            Self::Hybrid => "-hybrid",
            Self::Large => "-large",
        }
    }
}

/// `--engine emu|vllm` and `--model hybrid|large` from `args`, in any order, `--model`
/// limited to `models`.
fn engine_and_model(
    args: &[&str],
    models: &[BenchModel],
    usage: &str,
) -> anyhow::Result<(&'static str, BenchModel)> {
    let (mut engine, mut model) = ("emu", BenchModel::Bench);
    for pair in args.chunks(2) {
        match pair {
            ["--engine", "emu"] => engine = "emu",
            ["--engine", "vllm"] => engine = "vllm",
            ["--model", "hybrid"] => model = BenchModel::Hybrid,
            ["--model", "large"] => model = BenchModel::Large,
            _ => anyhow::bail!("usage: {usage}"),
        }
    }
    if model != BenchModel::Bench && !models.contains(&model) {
        anyhow::bail!("usage: {usage}");
    }
    Ok((engine, model))
}

/// The real-vLLM benchmarks' models for `model`: [`crate::vllm::BENCH`], its
/// GPT-OSS-shaped variant, or the large one and [`crate::vllm::BENCH`] beside it.
fn ensure_bench_model(model: BenchModel) -> anyhow::Result<()> {
    let venv = crate::vllm::ensure(&crate::vllm::newest()?)?;
    let shapes: &[&crate::vllm::ModelShape] = match model {
        BenchModel::Bench => &[&crate::vllm::BENCH],
        BenchModel::Hybrid => &[&crate::vllm::BENCH_HYBRID],
        BenchModel::Large => &[&crate::vllm::BENCH_LARGE, &crate::vllm::BENCH],
    };
    for shape in shapes {
        crate::vllm::ensure_model(&venv, shape)?;
    }
    Ok(())
}

/// The reference two-replica measurement -> `docs/benchmarks/seed/` (`-vllm` for real
/// vLLM, `-hybrid` for the hybrid-attention model).
pub fn seed(args: &[&str]) -> anyhow::Result<()> {
    let (engine, model) = engine_and_model(
        args,
        &[BenchModel::Hybrid],
        "cargo xtask bench seed [--engine emu|vllm] [--model hybrid]",
    )?;
    if engine == "vllm" {
        ensure_bench_model(model)?;
    }
    let out = sh::root().join(format!(
        "docs/benchmarks/seed{}{}",
        if engine == "vllm" { "-vllm" } else { "" },
        model.suffix()
    ));
    let out_arg = out.display().to_string();
    let mut bench_args = vec!["seed", &out_arg, engine];
    bench_args.extend(model.arg());
    let summary = stack_bench(&bench_args)?;
    println!("{summary}");
    println!("wrote {}", out.display());
    Ok(())
}

/// What each router adds per request, the peers page's last table alone, three runs ->
/// `docs/benchmarks/peers-overhead.md`.
pub fn peers_overhead() -> anyhow::Result<()> {
    sh::ensure_venv(&["vllm-router==0.1.17", "sglang-router==0.3.2"])?;
    let mut tables = String::new();
    for run in 1..=3 {
        writeln!(tables, "### Run {run}\n")?;
        tables.push_str(stack_bench(&["peers-overhead"])?.trim_end());
        tables.push_str("\n\n");
    }
    let md = include_str!("bench_peers_overhead.md")
        .replace("{{ENVOY}}", sh::ENVOY_VERSION)
        .replace("{{MACHINE}}", &machine())
        .replace("{{TABLES}}", tables.trim_end());
    write(&sh::root().join("docs/benchmarks/peers-overhead.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// kvaffine against vllm-router and sglang-router -> `docs/benchmarks/peers.md`
/// (`--engine vllm`: their workloads on real vLLM -> `docs/benchmarks/peers-vllm/`;
/// `--time-scale X`: on the emulator at another speed ->
/// `docs/benchmarks/peers-time-scale-X/`; `--runs N`, N odd, with either: the workloads N
/// times, tables of the medians).
pub fn peers(args: &[&str]) -> anyhow::Result<()> {
    sh::ensure_venv(&["vllm-router==0.1.17", "sglang-router==0.3.2"])?;
    let usage = "cargo xtask bench peers [--engine emu|vllm [--model large] [--runs N]] | --time-scale X [--runs N]";
    let (args, runs) = match args {
        [rest @ .., "--runs", n] => (rest, Some(odd_runs(n)?)),
        _ => (args, None),
    };
    let runs_args: Vec<String> = runs
        .map(|n| vec!["--runs".to_owned(), n.to_string()])
        .unwrap_or_default();
    match args {
        [] | ["--engine", "emu"] if runs.is_none() => {}
        ["--time-scale", scale] => {
            let value = positive(scale)?;
            let out = sh::root().join(format!("docs/benchmarks/peers-time-scale-{value}"));
            let (out_arg, scale) = (out.display().to_string(), value.to_string());
            let mut bench_args = vec!["peers", &out_arg, "--time-scale", &scale];
            bench_args.extend(runs_args.iter().map(String::as_str));
            println!("{}", stack_bench(&bench_args)?);
            return Ok(());
        }
        _ => {
            let (engine, model) = engine_and_model(args, &[BenchModel::Large], usage)?;
            anyhow::ensure!(engine == "vllm", "usage: {usage}");
            ensure_bench_model(model)?;
            let out = sh::root().join(format!("docs/benchmarks/peers-vllm{}", model.suffix()));
            let out_arg = out.display().to_string();
            let mut bench_args = vec!["peers", &out_arg, "vllm"];
            bench_args.extend(model.arg());
            bench_args.extend(runs_args.iter().map(String::as_str));
            println!("{}", stack_bench(&bench_args)?);
            return Ok(());
        }
    }
    let out = sh::root().join("docs/benchmarks");
    let md = stack_bench(&["peers", &out.display().to_string()])?;
    println!("{md}");
    Ok(())
}

/// `n` as an odd whole number, so that each median is one run's figure.
fn odd_runs(n: &str) -> anyhow::Result<usize> {
    n.parse::<usize>()
        .ok()
        .filter(|n| n % 2 == 1)
        .with_context(|| format!("--runs {n}: an odd whole number"))
}

/// The production scenarios -> `docs/benchmarks/README.md` and `docs/benchmarks/scenarios/`
/// (`--engine vllm`: on real vLLM beside the emulator at the same shapes ->
/// `docs/benchmarks/scenarios-vllm/`).
pub fn scenarios(args: &[&str]) -> anyhow::Result<()> {
    if let ["--time-scale", scale] = args {
        return scenarios_at(scale);
    }
    let usage =
        "cargo xtask bench scenarios [--engine emu|vllm] [--model hybrid|large] | --time-scale X";
    let (engine, model) = engine_and_model(args, &[BenchModel::Hybrid, BenchModel::Large], usage)?;
    match (engine, model) {
        ("vllm", _) => return scenarios_vllm(model),
        (_, BenchModel::Large) => anyhow::bail!("--model large is a real vLLM model: {usage}"),
        (_, BenchModel::Hybrid) => return scenarios_hybrid(),
        _ => {}
    }
    let out = sh::root().join("docs/benchmarks/scenarios");
    scenarios_page(
        &out,
        &[],
        include_str!("bench_scenarios.md"),
        &sh::root().join("docs/benchmarks/README.md"),
        &[],
    )
}

/// Runs the emulated scenarios into `out` (with `more` bench arguments) and writes
/// `template` to `page`, its `{{MACHINE}}`, `{{MINUTES}}` and `{{TABLE}}` filled in, and
/// each of `fills`.
fn scenarios_page(
    out: &Path,
    more: &[&str],
    template: &str,
    page: &Path,
    fills: &[(&str, String)],
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let out_arg = out.display().to_string();
    let mut args = vec!["scenarios", out_arg.as_str()];
    args.extend(more);
    let table = stack_bench(&args)?;
    let mut md = template
        .replace("{{MACHINE}}", &machine())
        .replace(
            "{{MINUTES}}",
            &format!("{:.1}", started.elapsed().as_secs_f64() / 60.0),
        )
        .replace("{{TABLE}}", &table);
    for (key, value) in fills {
        md = md.replace(key, value);
    }
    write(page, &md)?;
    println!("{md}");
    Ok(())
}

/// The emulator's modeled prefill speed at time scale 1 (GPT-OSS-20B), tokens a second.
const EMU_PREFILL_AT_SCALE_1: f64 = 5115.0;

/// A `--time-scale` value.
fn positive(scale: &str) -> anyhow::Result<f64> {
    scale
        .parse()
        .ok()
        .filter(|v: &f64| *v > 0.0)
        .context("--time-scale: a positive number")
}

/// The scenarios on the emulator at another speed than the reference runs' ->
/// `docs/benchmarks/scenarios-time-scale-X/`.
fn scenarios_at(scale: &str) -> anyhow::Result<()> {
    let value = positive(scale)?;
    let out = sh::root().join(format!("docs/benchmarks/scenarios-time-scale-{value}"));
    let scale = value.to_string();
    scenarios_page(
        &out,
        &["--time-scale", &scale],
        include_str!("bench_scenarios_time_scale.md"),
        &out.join("README.md"),
        &[
            ("{{TIME_SCALE}}", scale.clone()),
            (
                "{{PREFILL}}",
                format!("{:.0}", EMU_PREFILL_AT_SCALE_1 / value),
            ),
        ],
    )
}

/// The scenarios on emulated replicas serving GPT-OSS's attention layout ->
/// `docs/benchmarks/scenarios-hybrid/`.
fn scenarios_hybrid() -> anyhow::Result<()> {
    let out = sh::root().join("docs/benchmarks/scenarios-hybrid");
    scenarios_page(
        &out,
        &["emu", "hybrid"],
        include_str!("bench_scenarios_hybrid.md"),
        &out.join("README.md"),
        &[],
    )
}

/// The scenarios on real vLLM beside the emulator -> `docs/benchmarks/scenarios-vllm/`
/// (`-hybrid`, `-large` for the other models).
fn scenarios_vllm(bench_model: BenchModel) -> anyhow::Result<()> {
    ensure_bench_model(bench_model)?;
    let out = sh::root().join(format!(
        "docs/benchmarks/scenarios-vllm{}",
        bench_model.suffix()
    ));
    let started = std::time::Instant::now();
    let out_arg = out.display().to_string();
    let mut bench_args = vec!["scenarios", &out_arg, "vllm"];
    bench_args.extend(bench_model.arg());
    let tables = stack_bench(&bench_args)?;
    let pressure = if bench_model == BenchModel::Hybrid {
        "`cache-pressure` gives each replica 256 blocks\n  (`--num-gpu-blocks-override`, 4,096 tokens in each of its two groups, as the emulator's\n  512 x 16 beside its single-group 256 x 16)"
    } else {
        "`cache-pressure` gives each replica 128 blocks\n  (`--num-gpu-blocks-override`, 4,096 tokens, as the emulator's 256 x 16)"
    };
    let (lag, restart) = (
        "`event-lag` (its event lag cannot be set)",
        "`replica-restart` (a real\nreplica takes ~30 s to come back, longer than the workload)",
    );
    let not_run = if bench_model == BenchModel::Large {
        format!("{lag} and {restart}")
    } else {
        format!(
            "{lag}, {restart} and `heterogeneous` (its two replicas are one model here;\n[the large model's page](../scenarios-vllm-large/README.md) runs it)"
        )
    };
    let (title, command, model, emulator) = match bench_model {
        BenchModel::Hybrid => (
            "Production scenarios on real vLLM, hybrid attention, beside the emulator",
            "cargo xtask bench scenarios --engine vllm --model hybrid",
            "the hybrid benchmark model (4 layers alternating a 128-token sliding window and\n  full attention, GPT-OSS's layout, as a Gemma 3 with hidden 256, dummy weights, one\n  thread each; vLLM runs it with two KV-cache groups)",
            "two emulated replicas with `--sliding-window 128`",
        ),
        BenchModel::Large => (
            "Production scenarios on real vLLM, the larger model, beside the emulator",
            "cargo xtask bench scenarios --engine vllm --model large",
            "the large benchmark model (8 layers,\n  hidden 256: twice the layers of the benchmark model, about twice its compute per\n  token; dummy weights, one thread each; in `heterogeneous`, a mixed fleet, the first\n  replica is of this model and the second of the benchmark model, which serves under\n  the same name with the same tokenizer)",
            "two emulated replicas (in `heterogeneous` the first at twice the second's time\n  scale)",
        ),
        BenchModel::Bench => (
            "Production scenarios on real vLLM, beside the emulator",
            "cargo xtask bench scenarios --engine vllm",
            "the benchmark model (4 layers,\n  hidden 256, dummy weights, one thread each)",
            "two emulated replicas",
        ),
    };
    let md = include_str!("bench_scenarios_vllm.md")
        .replace("{{TITLE}}", title)
        .replace("{{COMMAND}}", command)
        .replace("{{MODEL}}", model)
        .replace("{{EMULATOR}}", emulator)
        .replace("{{PRESSURE}}", pressure)
        .replace("{{NOT_RUN}}", &not_run)
        .replace("{{MACHINE}}", &machine())
        .replace("{{VERSION}}", &crate::vllm::newest()?)
        .replace(
            "{{MINUTES}}",
            &format!("{:.1}", started.elapsed().as_secs_f64() / 60.0),
        )
        .replace("{{TABLES}}", &tables);
    write(&out.join("README.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// Steady traffic for a long time, every bounded structure sampled ->
/// `docs/benchmarks/soak/` (`--engine vllm`: `docs/benchmarks/soak-vllm/`), and the soak
/// section of `docs/reliability.md`.
pub fn soak(args: &[&str]) -> anyhow::Result<()> {
    let (mut minutes, mut engine) = ("30", "emu");
    let mut rest = args;
    while let [flag, value, tail @ ..] = rest {
        match *flag {
            "--minutes" if value.parse::<f64>().is_ok_and(|m| m > 0.0) => minutes = value,
            "--engine" if matches!(*value, "emu" | "vllm") => engine = value,
            _ => anyhow::bail!("usage: cargo xtask bench soak [--minutes N] [--engine emu|vllm]"),
        }
        rest = tail;
    }
    if !rest.is_empty() {
        anyhow::bail!("usage: cargo xtask bench soak [--minutes N] [--engine emu|vllm]");
    }
    let out = match engine {
        "vllm" => {
            let venv = crate::vllm::ensure(&crate::vllm::newest()?)?;
            crate::vllm::ensure_model(&venv, &crate::vllm::TINY)?;
            sh::root().join("docs/benchmarks/soak-vllm")
        }
        _ => sh::root().join("docs/benchmarks/soak"),
    };
    let md = stack_bench(&["soak", &out.display().to_string(), minutes, engine])?;
    // Paths as `docs/reliability.md` sees them.
    let dir = format!(
        "benchmarks/{}",
        out.file_name().and_then(|n| n.to_str()).unwrap_or("soak")
    );
    let body = format!(
        "### {engine}\n\nFrom [{dir}/README.md]({dir}/README.md).\n\n{}\n",
        md.replace("(soak.svg)", &format!("({dir}/soak.svg)"))
    );
    let path = sh::root().join("docs/reliability.md");
    let current = std::fs::read_to_string(&path)?;
    write(&path, &with_soak_section(&current, engine, &body)?)?;
    println!("{md}");
    Ok(())
}

/// Where the soak figures live in `docs/reliability.md`: one marked section per engine
/// between these two lines, which `bench reliability` keeps when it rewrites the rest.
const SOAK_SECTIONS: &str = "<!-- soak sections -->\n";
const SOAK_SECTIONS_END: &str = "<!-- /soak sections -->";

/// `text` with `engine`'s soak section replaced by `body` (or added after the others).
fn with_soak_section(text: &str, engine: &str, body: &str) -> anyhow::Result<String> {
    let (open, close) = (
        format!("<!-- soak {engine} -->\n"),
        format!("<!-- /soak {engine} -->\n"),
    );
    let section = format!("{open}{body}{close}");
    if let (Some(start), Some(end)) = (text.find(&open), text.find(&close)) {
        if start < end {
            return Ok(format!(
                "{}{section}{}",
                &text[..start],
                &text[end + close.len()..]
            ));
        }
    }
    let at = text.find(SOAK_SECTIONS_END).with_context(|| {
        format!("docs/reliability.md has no `{SOAK_SECTIONS_END}` line: `cargo xtask bench reliability` writes it")
    })?;
    Ok(format!("{}{section}{}", &text[..at], &text[at..]))
}

/// The soak sections of `text`, to carry into a regenerated `docs/reliability.md`.
fn soak_sections(text: &str) -> String {
    match (text.find(SOAK_SECTIONS), text.find(SOAK_SECTIONS_END)) {
        (Some(start), Some(end)) if start + SOAK_SECTIONS.len() <= end => {
            text[start + SOAK_SECTIONS.len()..end].to_owned()
        }
        _ => String::new(),
    }
}

/// Faults, load and ingest under load -> `docs/reliability.md`.
pub fn reliability() -> anyhow::Result<()> {
    let load = stack_bench(&["load"])?;
    let ingest = stack_bench(&["ingest"])?;
    let overload = stack_bench(&["overload"])?;
    let faults = Command::new(sh::cargo_bin())
        .args([
            "test",
            "--release",
            "-p",
            "kvaffine-e2e",
            "--test",
            "faults",
            "--",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .current_dir(sh::root())
        .output()
        .context("cannot run the fault tests")?;
    let fault_text = String::from_utf8_lossy(&faults.stdout);
    if !faults.status.success() {
        anyhow::bail!("the fault tests failed:\n{fault_text}");
    }
    let recoveries: Vec<&str> = fault_text
        .lines()
        .filter(|l| l.contains("routing by prefix again"))
        .map(|l| l.rsplit_once(" ... ").map_or(l, |(_, rest)| rest))
        .collect();
    let template = include_str!("reliability.md");
    let md = template
        .replace("{{MACHINE}}", &machine())
        .replace(
            "{{FAULTS}}",
            &recoveries
                .iter()
                .map(|l| format!("* {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
        )
        .replace("{{LOAD}}", &load)
        .replace("{{INGEST}}", &ingest)
        .replace("{{OVERLOAD}}", &overload)
        .replace(
            "{{SOAK}}",
            &soak_sections(
                &std::fs::read_to_string(sh::root().join("docs/reliability.md"))
                    .unwrap_or_default(),
            ),
        );
    write(&sh::root().join("docs/reliability.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// Runs `bench <args>` from `tests/e2e` against release builds of the stack.
fn stack_bench(args: &[&str]) -> anyhow::Result<String> {
    sh::ensure_wasm_target()?;
    sh::ensure_python_tools()?;
    sh::build_filter()?;
    e2e_bench(args)
}

/// Runs the e2e `bench` binary (release build) with `args`; returns its standard output.
fn e2e_bench(args: &[&str]) -> anyhow::Result<String> {
    sh::cargo(&[
        "build",
        "--release",
        "-p",
        "kvaffined",
        "-p",
        "vllm-emu",
        "-p",
        "kvaffine-e2e",
        "--bins",
    ])?;
    let output = Command::new(sh::root().join("target/release/bench"))
        .args(args)
        .env("KVAFFINE_MACHINE", machine())
        .current_dir(sh::root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cannot run the stack benchmark")?;
    if !output.status.success() {
        anyhow::bail!("bench {} failed: {}", args.join(" "), output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Latency and CPU the filter adds in Envoy -> `docs/benchmarks/filter.md`.
pub fn filter(args: &[&str]) -> anyhow::Result<()> {
    match args {
        [] | ["--engine", "emu"] => {}
        ["--engine", "vllm"] => return filter_vllm(),
        _ => anyhow::bail!("usage: cargo xtask bench filter [--engine emu|vllm]"),
    }
    let instant = stack_bench(&["filter", "hash"])?;
    let bpe = stack_bench(&["filter", "qwen"])?;
    let mut md = String::new();
    writeln!(md, "# What the filter adds\n")?;
    writeln!(
        md,
        "Command: `cargo xtask bench filter` (release builds; Envoy {} with `--concurrency 2`; two vllm-emu replicas at time scale 0, so the replicas answer at once and only the routing path differs).",
        sh::ENVOY_VERSION
    )?;
    writeln!(md, "Machine: {}.\n", machine())?;
    writeln!(
        md,
        "Each block of rows sends the same chat requests through one Envoy along each path in turn, interleaved round by round: `/direct/` (the filter disabled on that route, round robin: the baseline of the \"added\" columns), `/load-only/`, `/approximate/`, `/` (precise: buffer, `/tokenize` callout, keys, lookup callout, pin) and `/index-tokenized/` (precise with the tokenizer call made by kvaffined: buffer, one `/v2/route` callout, pin). Client, Envoy, replicas and kvaffined share the machine's 2 cores. CPU comes from /proc (per-thread schedstat, nanoseconds; runs before that used 10 ms ticks, so their per-request CPU moves in steps of 25-62 us), Envoy's and kvaffined's apart; **added CPU** is both together, less the `/direct/` arm's.\n"
    )?;
    writeln!(
        md,
        "The whole table runs twice: with the emulator's instant hash tokenizer (the routing path alone), then with its Qwen BPE tokenizer (`--tokenizer qwen`: what `/tokenize` costs on a real vLLM tokenizer, paid by precise mode on every request). Rows compare within one table; the two tables ran one after the other.\n"
    )?;
    writeln!(md, "## Instant tokenizer (`--tokenizer hash`)\n")?;
    md.push_str(&instant);
    writeln!(md, "\n\n## Qwen BPE tokenizer (`--tokenizer qwen`)\n")?;
    md.push_str(&bpe);
    md.push_str("\n\n");
    md.push_str(include_str!("bench_filter_notes.md"));
    write(&sh::root().join("docs/benchmarks/filter.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// Where precise mode's pause goes, from the filter's own Envoy histograms against the
/// callouts timed directly and its work run natively -> `docs/benchmarks/filter-profile.md`.
pub fn filter_profile() -> anyhow::Result<()> {
    let table = stack_bench(&["filter-profile", "hash"])?;
    page(
        include_str!("bench_filter_profile.md"),
        "filter-profile",
        &[("{{TABLE}}", &table)],
    )
}

/// A gateway's kvaffined restarted between a fresh prefix's first request and its
/// siblings, its daemon peered or not -> `docs/benchmarks/restart.md`.
pub fn restart() -> anyhow::Result<()> {
    let table = stack_bench(&["restart"])?;
    page(
        include_str!("bench_restart.md"),
        "restart",
        &[("{{TABLE}}", &table)],
    )
}

/// The filter's cost with `report_outcomes` on and off, side by side in one run ->
/// `docs/benchmarks/outcomes.md`.
pub fn outcomes() -> anyhow::Result<()> {
    let table = stack_bench(&["outcomes"])?;
    page(
        include_str!("bench_outcomes.md"),
        "outcomes",
        &[("{{TABLE}}", &table)],
    )
}

/// The same table with two real vLLM replicas of the tests' model behind the filter ->
/// `docs/benchmarks/filter-vllm.md`.
fn filter_vllm() -> anyhow::Result<()> {
    crate::vllm::ensure_newest()?;
    let table = stack_bench(&["filter", "vllm"])?;
    page(
        include_str!("bench_filter_vllm.md"),
        "filter-vllm",
        &[
            ("{{VERSION}}", &crate::vllm::newest()?),
            ("{{TABLE}}", &table),
        ],
    )
}

/// What precise routing adds to a continuation on real vLLM, against the tokenizer's own
/// time, with where the filter's time goes -> `docs/benchmarks/precise-cost.md`.
pub fn precise_cost() -> anyhow::Result<()> {
    crate::vllm::ensure_newest()?;
    let table = stack_bench(&["precise-cost"])?;
    page(
        include_str!("bench_precise_cost.md"),
        "precise-cost",
        &[
            ("{{VERSION}}", &crate::vllm::newest()?),
            ("{{TABLE}}", &table),
        ],
    )
}

/// Real vLLM's prefill time by prompt length and cached prefix, beside the ranking's cost
/// model -> `docs/benchmarks/prefill-shape.md`.
pub fn prefill_shape() -> anyhow::Result<()> {
    ensure_bench_model(BenchModel::Large)?;
    let tables = e2e_bench(&["prefill-shape"])?;
    page(
        include_str!("bench_prefill_shape.md"),
        "prefill-shape",
        &[
            ("{{VERSION}}", &crate::vllm::newest()?),
            ("{{TABLES}}", &tables),
        ],
    )
}

/// Writes `template` to `docs/benchmarks/{name}.md` and prints it, its `{{ENVOY}}` and
/// `{{MACHINE}}` filled in, and each of `fills`.
fn page(template: &str, name: &str, fills: &[(&str, &str)]) -> anyhow::Result<()> {
    let mut md = template
        .replace("{{ENVOY}}", sh::ENVOY_VERSION)
        .replace("{{MACHINE}}", &machine());
    for (placeholder, value) in fills {
        md = md.replace(placeholder, value);
    }
    write(&sh::root().join(format!("docs/benchmarks/{name}.md")), &md)?;
    println!("{md}");
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
