//! `bench filter`: the latency and CPU the filter adds in a real Envoy, against the same
//! Envoy without it. Run by `cargo xtask bench filter` (release builds), which writes
//! `docs/benchmarks/filter.md`.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use kvaffine_e2e::load::{
    Bodies, Latencies, chat_body, closed_loop, cpu_seconds, fresh_salts, ms, same,
};
use kvaffine_e2e::{Stack, StackConfig};
use serde_json::json;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("filter") => filter(),
        Some("seed") => seed(args.get(1).context("usage: bench seed OUT_DIR")?),
        _ => bail!("usage: bench filter | bench seed OUT_DIR"),
    }
}

#[derive(Default)]
struct Arm {
    latencies: Latencies,
    failures: usize,
    cpu: f64,
    requests: usize,
}

/// One way through the gateway: a name, a URL, and whether every request carries a
/// prompt never seen before (a fresh salt) or the round's prompt again.
struct Route {
    name: &'static str,
    url: String,
    fresh: bool,
}

fn filter() -> anyhow::Result<()> {
    let stack = Stack::start(StackConfig {
        block_size: 64,
        replica_args: vec![
            "--time-scale".into(),
            "0".into(),
            "--num-gpu-blocks".into(),
            "65536".into(),
        ],
        ..StackConfig::default()
    })?;
    let pid = stack.envoy_pid().context("no Envoy")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()?;
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
    ];
    let mut out = String::new();
    writeln!(
        out,
        "| prompt | concurrency | path | requests | p50 | p99 | added p50 | added p99 | Envoy CPU per request | added CPU | failed |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|")?;
    let sizes = [
        ("2 KB", 2 * 1024, 10),
        ("32 KB (~7k tokens)", 32 * 1024, 8),
        ("220 KB", 220 * 1024, 4),
    ];
    for (label, bytes, rounds) in sizes {
        for concurrency in [1usize, 20] {
            let per_round = if concurrency == 1 { 40 } else { 100 };
            // At concurrency 20 only the ends are compared, to keep the run short.
            let chosen: Vec<&Route> = if concurrency == 1 {
                routes.iter().collect()
            } else {
                vec![&routes[0], &routes[3], &routes[4]]
            };
            let mut arms: Vec<Arm> = chosen.iter().map(|_| Arm::default()).collect();
            // Warm every path (connections, VMs, caches).
            for route in &chosen {
                let body = same(chat_body(bytes, "warm").to_string().into_bytes());
                runtime.block_on(closed_loop(&client, &route.url, body, 20, concurrency));
            }
            // Interleave the arms round by round, so machine noise hits all alike.
            for round in 0..rounds {
                for (n, (arm, route)) in arms.iter_mut().zip(&chosen).enumerate() {
                    let bodies: Bodies = if route.fresh {
                        let template = chat_body(bytes, "SALTXXXXXXXX").to_string().into_bytes();
                        fresh_salts(template, round * 10 + n)
                    } else {
                        same(
                            chat_body(bytes, &format!("r{round}"))
                                .to_string()
                                .into_bytes(),
                        )
                    };
                    let before = cpu_seconds(pid);
                    let (latencies, failures) = runtime.block_on(closed_loop(
                        &client,
                        &route.url,
                        bodies,
                        per_round,
                        concurrency,
                    ));
                    arm.cpu += cpu_seconds(pid) - before;
                    arm.requests += per_round;
                    arm.failures += failures;
                    arm.latencies.extend(latencies);
                }
            }
            let base = &arms[0];
            let base_cpu = base.cpu / base.requests as f64 * 1e6;
            for (arm, route) in arms.iter().zip(&chosen) {
                let cpu = arm.cpu / arm.requests as f64 * 1e6;
                writeln!(
                    out,
                    "| {label} | {concurrency} | {} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {cpu:.0} us | {:.0} us | {} |",
                    route.name,
                    arm.requests,
                    ms(arm.latencies.quantile(0.5)),
                    ms(arm.latencies.quantile(0.99)),
                    ms(arm.latencies.quantile(0.5)) - ms(base.latencies.quantile(0.5)),
                    ms(arm.latencies.quantile(0.99)) - ms(base.latencies.quantile(0.99)),
                    cpu - base_cpu,
                    arm.failures,
                )?;
            }
        }
    }
    // The callouts on their own, as the filter makes them (one connection, closed loop).
    writeln!(
        out,
        "\n| callout, measured directly | size | p50 | p99 |\n|---|---|---|---|"
    )?;
    for (label, bytes) in [
        ("2 KB", 2 * 1024),
        ("32 KB", 32 * 1024),
        ("220 KB", 220 * 1024),
    ] {
        let body = chat_body(bytes, "t");
        let url = format!("http://{}/tokenize", stack.replicas[0].http);
        let (latencies, _) = runtime.block_on(closed_loop(
            &client,
            &url,
            same(body.to_string().into_bytes()),
            200,
            1,
        ));
        writeln!(
            out,
            "| vllm-emu `/tokenize` | {label} prompt | {:.2} ms | {:.2} ms |",
            ms(latencies.quantile(0.5)),
            ms(latencies.quantile(0.99))
        )?;
    }
    for keys in [32usize, 512, 3500] {
        let lookup = json!({"keys": (0..keys as u64).collect::<Vec<_>>(), "book": {}});
        let url = format!("http://{}/v1/lookup", stack.daemon_addr);
        let (latencies, _) = runtime.block_on(closed_loop(
            &client,
            &url,
            same(lookup.to_string().into_bytes()),
            500,
            1,
        ));
        writeln!(
            out,
            "| kvaffined `/v1/lookup` | {keys} keys | {:.2} ms | {:.2} ms |",
            ms(latencies.quantile(0.5)),
            ms(latencies.quantile(0.99))
        )?;
    }
    println!("{out}");
    Ok(())
}

fn seed(out: &str) -> anyhow::Result<()> {
    let (pairs, tokens) = kvaffine_e2e::seed::run()?;
    let machine = std::env::var("KVAFFINE_MACHINE").unwrap_or_default();
    kvaffine_e2e::seed::write(
        std::path::Path::new(out),
        &pairs,
        tokens,
        "cargo xtask bench seed",
        &machine,
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
