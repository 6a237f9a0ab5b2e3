//! kvaffine against the routers users would pick instead, on the same vllm-emu replicas
//! and workloads in one run: vllm-router (`cache_aware`, `kv_aware`) and sglang-router
//! (`cache_aware`) from PyPI, plain round robin, and kvaffine's precise and approximate
//! modes. Every arm gets a fresh stack per workload, arms take turns so machine noise hits
//! all alike, and every figure comes from the client or the replicas' own counters, so no
//! router is measured by its own account.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use vllm_emu::harness::http;

use crate::load::{Bodies, Latencies, closed_loop, cpu_seconds, median, ms};
use crate::scenarios::{self, Run, Scenario, queried_tokens};
use crate::session::salt_as_text;
use crate::{Stack, StackConfig, poll, root};

/// How an arm's requests reach the replicas.
#[derive(Clone, Copy, Debug)]
pub enum Router {
    /// kvaffine's filter in Envoy, on the route with this prefix.
    Kvaffine(&'static str),
    /// Envoy's round robin with the filter off (`/direct/`).
    RoundRobin,
    /// `vllm-router --policy POLICY`.
    VllmRouter(&'static str),
    /// `sglang-router launch --policy POLICY`.
    SglangRouter(&'static str),
}

/// One router under test.
#[derive(Clone, Copy, Debug)]
pub struct Arm {
    /// Name in the tables.
    pub name: &'static str,
    /// The router.
    pub router: Router,
}

/// Every arm, kvaffine precise first (the ratios' reference).
pub const ARMS: [Arm; 6] = [
    Arm {
        name: "kvaffine precise",
        router: Router::Kvaffine("/"),
    },
    Arm {
        name: "kvaffine approximate",
        router: Router::Kvaffine("/approximate/"),
    },
    Arm {
        name: "vllm-router cache_aware",
        router: Router::VllmRouter("cache_aware"),
    },
    Arm {
        name: "vllm-router kv_aware",
        router: Router::VllmRouter("kv_aware"),
    },
    Arm {
        name: "sglang-router cache_aware",
        router: Router::SglangRouter("cache_aware"),
    },
    Arm {
        name: "round robin",
        router: Router::RoundRobin,
    },
];

/// The arms whose added latency and CPU are measured: every router, and kvaffine precise
/// with its tokenizer call made by kvaffined (`/index-tokenized/`, one callout instead of
/// two), which routes as precise does.
pub const OVERHEAD_ARMS: [Arm; 7] = [
    ARMS[0],
    Arm {
        name: "kvaffine precise, tokenized by kvaffined",
        router: Router::Kvaffine("/index-tokenized/"),
    },
    ARMS[1],
    ARMS[2],
    ARMS[3],
    ARMS[4],
    ARMS[5],
];

/// A peer router process, killed on drop.
pub struct PeerProcess {
    child: Child,
    /// `HOST:PORT` it serves on.
    pub addr: String,
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn venv_bin(name: &str) -> PathBuf {
    root().join(".venv/bin").join(name)
}

/// Two ports free right now, distinct (both are held until both are chosen). The peers
/// take `--port` and cannot report a port they chose; a port taken between here and the
/// peer's bind fails its start loudly.
fn free_ports() -> anyhow::Result<(u16, u16)> {
    let (a, b) = (
        std::net::TcpListener::bind("127.0.0.1:0")?,
        std::net::TcpListener::bind("127.0.0.1:0")?,
    );
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// A replica as a peer router is told of it: its HTTP address and its event sockets.
pub struct Worker {
    /// `HOST:PORT`.
    pub http: String,
    /// Its ZMQ PUB endpoint.
    pub events: String,
    /// Its ZMQ replay endpoint, if it has one.
    pub replay: Option<String>,
}

impl Worker {
    /// The replicas `stack` routes to, from the `--endpoint HTTP=EVENTS[,REPLAY]` it gives
    /// kvaffined (emulated or real alike).
    pub fn of(stack: &Stack) -> Vec<Self> {
        stack
            .upstreams
            .iter()
            .map(|u| {
                let sockets = u
                    .events
                    .as_deref()
                    .and_then(|flag| flag.split_once('='))
                    .map_or("", |(_, sockets)| sockets);
                let (events, replay) = match sockets.split_once(',') {
                    Some((events, replay)) => (events.to_owned(), Some(replay.to_owned())),
                    None => (sockets.to_owned(), None),
                };
                Self {
                    http: u.http.clone(),
                    events,
                    replay,
                }
            })
            .collect()
    }
}

impl PeerProcess {
    /// Starts the peer router of `router` in front of `replicas` serving `model` (`None`
    /// for kvaffine and round robin, which are routes of the stack's Envoy).
    pub fn start(
        router: Router,
        replicas: &[Worker],
        block_size: usize,
        model: &str,
    ) -> anyhow::Result<Option<Self>> {
        let (port, metrics_port) = free_ports()?;
        let workers: Vec<String> = replicas
            .iter()
            .map(|r| format!("http://{}", r.http))
            .collect();
        let mut command = match router {
            Router::Kvaffine(_) | Router::RoundRobin => return Ok(None),
            Router::VllmRouter(policy) => {
                let mut command = Command::new(venv_bin("vllm-router"));
                command
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .arg("--worker-urls")
                    .args(&workers)
                    .args(["--policy", policy])
                    .args(["--prometheus-port", &metrics_port.to_string()]);
                if policy == "kv_aware" {
                    for (worker, replica) in workers.iter().zip(replicas) {
                        command
                            .arg("--kv-event-source")
                            .arg(format!("{worker}={}", replica.events));
                        if let Some(replay) = &replica.replay {
                            command
                                .arg("--kv-event-replay-source")
                                .arg(format!("{worker}={replay}"));
                        }
                    }
                    command
                        .args(["--kv-event-block-size", &block_size.to_string()])
                        .args(["--kv-event-model", model]);
                }
                command
            }
            Router::SglangRouter(policy) => {
                let mut command = Command::new(venv_bin("sglang-router"));
                command
                    .args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
                    .arg("--worker-urls")
                    .args(&workers)
                    .args(["--policy", policy])
                    .args(["--prometheus-host", "127.0.0.1"])
                    .args(["--prometheus-port", &metrics_port.to_string()]);
                command
            }
        };
        let log_dir = root().join("target/peers");
        std::fs::create_dir_all(&log_dir)?;
        let log = std::fs::File::create(log_dir.join(format!("{port}.log")))?;
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {router:?}: run `cargo xtask bench peers`"))?;
        let peer = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        poll(
            &format!("{router:?} on {}", peer.addr),
            Duration::from_secs(60),
            || http(&peer.addr, "GET", "/v1/models", "").0 == 200,
        )?;
        Ok(Some(peer))
    }

    /// The router's process id (for CPU accounting).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Base URL of an arm on a stack (with its peer process, if any).
fn base_url(arm: Arm, stack: &Stack, peer: Option<&PeerProcess>) -> String {
    match (arm.router, peer) {
        (Router::Kvaffine(prefix), _) => format!("http://{}{prefix}", stack.gateway),
        (Router::RoundRobin, _) => format!("http://{}/direct/", stack.gateway),
        (_, Some(peer)) => format!("http://{}/", peer.addr),
        (_, None) => String::new(),
    }
}

/// Processes whose CPU an arm costs: Envoy and kvaffined for kvaffine, Envoy alone for
/// round robin, the router process for a peer.
fn router_pids(arm: Arm, stack: &Stack, peer: Option<&PeerProcess>) -> Vec<u32> {
    match arm.router {
        Router::Kvaffine(_) => stack
            .processes()
            .into_iter()
            .filter(|(name, _)| name == "envoy" || name == "kvaffined")
            .map(|(_, pid)| pid)
            .collect(),
        Router::RoundRobin => stack.envoy_pid().into_iter().collect(),
        _ => peer.map(PeerProcess::pid).into_iter().collect(),
    }
}

/// The scenario workloads the peers run.
pub fn workloads() -> Vec<Scenario> {
    scenarios::all()
        .into_iter()
        .filter(|s| {
            matches!(
                s.name,
                "template-divergence" | "concurrency" | "hot-system-prompt" | "heterogeneous"
            )
        })
        .collect()
}

/// Runs `workload` under `arm` on a fresh stack of `engine`.
pub fn run_workload(
    engine: &mut scenarios::Engine,
    workload: &Scenario,
    arm: Arm,
) -> anyhow::Result<Run> {
    let (block_size, model) = (engine.block_size(), engine.model());
    scenarios::run_through(
        engine,
        workload,
        arm.name,
        true,
        scenarios::Topology::Daemons(1),
        true,
        |stack| {
            let peer = PeerProcess::start(arm.router, &Worker::of(stack), block_size, model)?;
            let url = format!("{}v1/chat/completions", base_url(arm, stack, peer.as_ref()));
            Ok((url, peer))
        },
    )
}

/// Every workload under every arm, `rounds` times, each workload on the engine
/// `engine_for` gives it (real replicas start once per workload and serve all its rounds),
/// the arms' order rotated per workload and per round so no router always runs first or
/// last; one list of runs per round, workload by workload in [`ARMS`] order.
pub fn run_all(
    workloads: Vec<Scenario>,
    rounds: usize,
    mut engine_for: impl FnMut(&Scenario) -> anyhow::Result<scenarios::Engine>,
) -> anyhow::Result<Vec<Vec<Run>>> {
    let mut runs = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        let mut engine = engine_for(workload)?;
        for round in 0..rounds {
            for k in 0..ARMS.len() {
                let a = (k + w + round) % ARMS.len();
                eprintln!(
                    "{} under {} (run {} of {rounds}) ...",
                    workload.name,
                    ARMS[a].name,
                    round + 1
                );
                runs.push((round, w, a, run_workload(&mut engine, workload, ARMS[a])?));
            }
        }
    }
    runs.sort_by_key(|(round, w, a, _)| (*round, *w, *a));
    let mut by_round: Vec<Vec<Run>> = (0..rounds).map(|_| Vec::new()).collect();
    for (round, _, _, run) in runs {
        by_round[round].push(run);
    }
    Ok(by_round)
}

/// The two-turn reference measurement under every arm, pair by pair in turn.
pub struct SeedPair {
    /// Arm name.
    pub arm: &'static str,
    /// The continuation went to the first turn's replica.
    pub warm_return: bool,
    /// Continuation input tokens.
    pub input_tokens: u64,
    /// Of which cached.
    pub cached_tokens: u64,
    /// Continuation latency.
    pub latency_ms: f64,
}

/// Which replica served the one request sent since `before` (sequential traffic only).
fn served_since(replicas: &[String], before: &[u64]) -> Option<usize> {
    let after = queried_tokens(replicas);
    after.iter().zip(before).position(|(a, b)| a > b)
}

/// Runs `pairs` two-turn pairs per arm on one stack (2 replicas at the published latency
/// model), every router in front of the same replicas at once.
pub fn seed(pairs: usize) -> anyhow::Result<Vec<SeedPair>> {
    let (words, pad) = crate::seed::calibrate()?;
    let stack = crate::seed::reference_stack(false)?;
    let peers: Vec<Option<PeerProcess>> = ARMS
        .iter()
        .map(|arm| PeerProcess::start(arm.router, &Worker::of(&stack), 64, "emu-model"))
        .collect::<anyhow::Result<_>>()?;
    let replicas: Vec<String> = stack.replicas.iter().map(|r| r.http.clone()).collect();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let mut out = Vec::new();
    for index in 0..pairs {
        for (arm_index, (arm, peer)) in ARMS.iter().zip(&peers).enumerate() {
            let base = base_url(*arm, &stack, peer.as_ref());
            let (addr, prefix) = split_url(&base);
            let path = format!("{prefix}v1/responses");
            // Fixed width, so every arm's prompts have the calibrated token count.
            let salt = format!(
                "{:032x}",
                nonce ^ ((index * ARMS.len() + arm_index) as u128) << 64
            );
            let mut first = crate::seed::first_turn("emu-model", words, &salt);
            salt_as_text(&mut first);
            let before = queried_tokens(&replicas);
            let reply = crate::client::post_json(&addr, &path, &first);
            if reply.status != 200 {
                bail!(
                    "{} pair {index}: first turn {}: {}",
                    arm.name,
                    reply.status,
                    reply.body
                );
            }
            let first_replica = served_since(&replicas, &before);
            let mut body =
                crate::seed::continuation("emu-model", words, pad, &salt, &reply.json()["output"]);
            salt_as_text(&mut body);
            let before = queried_tokens(&replicas);
            let start = Instant::now();
            let second = crate::client::post_json(&addr, &path, &body);
            let latency_ms = start.elapsed().as_secs_f64() * 1e3;
            if second.status != 200 {
                bail!(
                    "{} pair {index}: continuation {}: {}",
                    arm.name,
                    second.status,
                    second.body
                );
            }
            let usage = &second.json()["usage"];
            out.push(SeedPair {
                arm: arm.name,
                warm_return: first_replica.is_some()
                    && first_replica == served_since(&replicas, &before),
                input_tokens: usage["input_tokens"].as_u64().unwrap_or(0),
                cached_tokens: usage["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
                latency_ms,
            });
        }
    }
    Ok(out)
}

/// `http://HOST:PORT/prefix/` -> (`HOST:PORT`, `/prefix/`).
fn split_url(url: &str) -> (String, String) {
    let rest = url.trim_start_matches("http://");
    match rest.find('/') {
        Some(at) => (rest[..at].to_owned(), rest[at..].to_owned()),
        None => (rest.to_owned(), "/".to_owned()),
    }
}

/// What a router adds to one request, against the same requests sent straight to a
/// replica by the same client.
pub struct Overhead {
    /// Arm name.
    pub arm: &'static str,
    /// Latency through the router.
    pub latencies: Latencies,
    /// Latency straight to a replica, measured in the same rounds.
    pub direct: Latencies,
    /// Router CPU seconds per request.
    pub cpu_per_request: f64,
    /// Failed requests.
    pub failed: usize,
}

/// Sequential chat requests of about `bytes` bytes (a new prompt each round, no salt)
/// through each arm and straight to replica 0, interleaved round by round.
pub fn overhead(bytes: usize, rounds: usize, per_round: usize) -> anyhow::Result<Vec<Overhead>> {
    let stack = Stack::start(StackConfig {
        block_size: 16,
        replica_args: vec!["--time-scale".into(), "0".into()],
        ..StackConfig::default()
    })?;
    let peers: Vec<Option<PeerProcess>> = OVERHEAD_ARMS
        .iter()
        .map(|arm| PeerProcess::start(arm.router, &Worker::of(&stack), 16, "emu-model"))
        .collect::<anyhow::Result<_>>()?;
    let runtime = crate::load::runtime()?;
    let client = crate::load::client()?;
    let direct_url = format!("http://{}/v1/chat/completions", stack.replicas[0].http);
    let mut results: Vec<Overhead> = OVERHEAD_ARMS
        .iter()
        .map(|arm| Overhead {
            arm: arm.name,
            latencies: Latencies::default(),
            direct: Latencies::default(),
            cpu_per_request: 0.0,
            failed: 0,
        })
        .collect();
    let mut cpu = vec![0.0f64; OVERHEAD_ARMS.len()];
    for round in 0..rounds {
        for (n, ((arm, peer), result)) in OVERHEAD_ARMS
            .iter()
            .zip(&peers)
            .zip(&mut results)
            .enumerate()
        {
            let body = overhead_body(bytes, round * OVERHEAD_ARMS.len() + n);
            let url = format!(
                "{}v1/chat/completions",
                base_url(*arm, &stack, peer.as_ref())
            );
            let pids = router_pids(*arm, &stack, peer.as_ref());
            let direct = runtime.block_on(closed_loop(
                &client,
                &direct_url,
                body.clone(),
                per_round,
                1,
            ));
            let before: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
            let (latencies, failed) =
                runtime.block_on(closed_loop(&client, &url, body, per_round, 1));
            cpu[n] += pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>() - before;
            result.latencies.extend(latencies);
            result.direct.extend(direct.0);
            result.failed += failed + direct.1;
        }
    }
    for (result, cpu) in results.iter_mut().zip(cpu) {
        result.cpu_per_request = cpu / (rounds * per_round).max(1) as f64;
    }
    Ok(results)
}

/// A chat body of about `bytes` bytes whose text is new for every `n`, and whose later
/// requests in a round repeat it (the warm case every router should handle).
fn overhead_body(bytes: usize, n: usize) -> Bodies {
    let mut text = format!("request family {n}: ");
    let mut i = 0usize;
    while text.len() < bytes {
        text.push_str(&format!("w{} ", (i * 7919 + n * 31) % 9973));
        i += 1;
    }
    let body = json!({"model": "emu-model", "max_tokens": 1,
                      "messages": [{"role": "user", "content": text}]})
    .to_string()
    .into_bytes();
    crate::load::same(body)
}

/// Ratio of `x` to `reference`, as text.
fn ratio(x: f64, reference: f64) -> String {
    if reference > 0.0 {
        format!("{:.2}x", x / reference)
    } else {
        "n/a".into()
    }
}

/// Mean continuation latency of an arm in the two-turn reference.
fn seed_latency(seed: &[SeedPair], arm: &str) -> f64 {
    let latencies: Vec<f64> = seed
        .iter()
        .filter(|p| p.arm == arm)
        .map(|p| p.latency_ms)
        .collect();
    latencies.iter().sum::<f64>() / latencies.len().max(1) as f64
}

/// One table: every router's figures as ratios to kvaffine precise's in the same run.
fn summary(
    md: &mut String,
    runs: &[Run],
    seed: &[SeedPair],
    overheads: &[Overhead],
) -> std::fmt::Result {
    use std::fmt::Write as _;
    let names: Vec<&str> = workloads().iter().map(|w| w.name).collect();
    let figures = |workload: &str, arm: &str| {
        runs.iter()
            .find(|r| r.scenario == workload && r.profile == arm)
            .map(Run::figures)
    };
    let added = |arm: &str| {
        overheads.iter().find(|o| o.arm == arm).map(|o| {
            (
                ms(o.latencies.quantile(0.5)) - ms(o.direct.quantile(0.5)),
                o.cpu_per_request,
            )
        })
    };
    writeln!(md, "\n## Ratios to kvaffine precise\n")?;
    writeln!(
        md,
        "KV hit, TTFT p99 and throughput per scenario ({}), the two-turn reference's mean continuation latency, and what each router adds per request. Above 1.00x is more hit, more latency, more throughput, more cost.\n",
        names.join(", ")
    )?;
    let header: Vec<String> = ["KV hit", "TTFT p99", "req/s"]
        .iter()
        .flat_map(|m| names.iter().map(move |n| format!("{m} {n}")))
        .collect();
    writeln!(
        md,
        "| router | {} | two-turn latency | added p50 | CPU per request |",
        header.join(" | ")
    )?;
    writeln!(md, "|---|{}---|---|---|", "---|".repeat(header.len()))?;
    let reference = ARMS[0].name;
    for arm in &ARMS {
        let mut cells = Vec::new();
        for metric in 0..3 {
            for name in &names {
                let cell = match (figures(name, arm.name), figures(name, reference)) {
                    (Some(f), Some(r)) => match metric {
                        0 => ratio(f.hit_pct, r.hit_pct),
                        1 => ratio(f.ttft_p99_ms, r.ttft_p99_ms),
                        _ => ratio(f.throughput, r.throughput),
                    },
                    _ => "n/a".into(),
                };
                cells.push(cell);
            }
        }
        let (added_p50, cpu) = match (added(arm.name), added(reference)) {
            (Some((a, c)), Some((ra, rc))) => (ratio(a, ra), ratio(c, rc)),
            _ => ("n/a".into(), "n/a".into()),
        };
        writeln!(
            md,
            "| {} | {} | {} | {added_p50} | {cpu} |",
            arm.name,
            cells.join(" | "),
            ratio(seed_latency(seed, arm.name), seed_latency(seed, reference)),
        )?;
    }
    Ok(())
}

/// Writes `peers.md`, `peers.json` and one chart per workload into `dir`.
pub fn write(
    dir: &Path,
    runs: &[Run],
    seed: &[SeedPair],
    overheads: &[Overhead],
    command: &str,
    machine: &str,
) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir.join("peers"))?;
    let mut md = String::from("# kvaffine and the routers users would pick instead\n\n");
    writeln!(md, "Command: `{command}`. Machine: {machine}.\n")?;
    md.push_str(include_str!("peers_intro.md"));
    summary(&mut md, runs, seed, overheads)?;
    let json_runs = scenario_tables(&mut md, dir, runs)?;
    writeln!(md, "## The two-turn reference measurement\n")?;
    writeln!(
        md,
        "| router | warm returns | mean KV hit | mean continuation latency | latency vs precise |\n|---|---|---|---|---|"
    )?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let latency_of = |arm: &str| {
        let l: Vec<f64> = seed
            .iter()
            .filter(|p| p.arm == arm)
            .map(|p| p.latency_ms)
            .collect();
        mean(&l)
    };
    let reference = latency_of(ARMS[0].name);
    let mut json_seed = Vec::new();
    for arm in &ARMS {
        let mine: Vec<&SeedPair> = seed.iter().filter(|p| p.arm == arm.name).collect();
        let hits: Vec<f64> = mine
            .iter()
            .map(|p| 100.0 * p.cached_tokens as f64 / p.input_tokens.max(1) as f64)
            .collect();
        let warm = mine.iter().filter(|p| p.warm_return).count();
        let latency = seed_latency(seed, arm.name);
        writeln!(
            md,
            "| {} | {warm}/{} | {:.2}% | {latency:.1} ms | {} |",
            arm.name,
            mine.len(),
            mean(&hits),
            ratio(latency, reference),
        )?;
        json_seed.push(
            json!({"router": arm.name, "warm_returns": warm, "pairs": mine.len(),
            "mean_hit_pct": mean(&hits), "mean_latency_ms": latency}),
        );
    }
    writeln!(md, "\n## What each router adds per request\n")?;
    let json_overhead = overhead_table(&mut md, overheads)?;
    md.push('\n');
    md.push_str(include_str!("peers_notes.md"));
    let results = json!({"command": command, "machine": machine, "scenarios": json_runs,
                         "seed": json_seed, "overhead": json_overhead});
    std::fs::write(
        dir.join("peers/peers.json"),
        serde_json::to_string_pretty(&results)? + "\n",
    )?;
    std::fs::write(dir.join("peers.md"), &md)?;
    Ok(md)
}

/// The table of what each router adds per request; returns its figures as JSON.
pub fn overhead_table(
    md: &mut String,
    overheads: &[Overhead],
) -> anyhow::Result<Vec<serde_json::Value>> {
    use std::fmt::Write as _;
    writeln!(
        md,
        "| router | p50 | direct p50 (same rounds) | added p50 | p99 | direct p99 | added p99 | router CPU per request | failed |\n|---|---|---|---|---|---|---|---|---|"
    )?;
    let mut json_overhead = Vec::new();
    for o in overheads {
        let (p50, d50) = (ms(o.latencies.quantile(0.5)), ms(o.direct.quantile(0.5)));
        let (p99, d99) = (ms(o.latencies.quantile(0.99)), ms(o.direct.quantile(0.99)));
        writeln!(
            md,
            "| {} | {p50:.2} ms | {d50:.2} ms | {:.2} ms | {p99:.2} ms | {d99:.2} ms | {:.2} ms | {:.0} us | {} |",
            o.arm,
            p50 - d50,
            p99 - d99,
            o.cpu_per_request * 1e6,
            o.failed
        )?;
        json_overhead.push(json!({"router": o.arm, "p50_ms": p50, "direct_p50_ms": d50,
            "p99_ms": p99, "direct_p99_ms": d99, "cpu_us_per_request": o.cpu_per_request * 1e6,
            "failed": o.failed}));
    }
    Ok(json_overhead)
}

/// One table and chart per workload (the first router of each is the ratios'
/// reference); returns the figures as JSON.
fn scenario_tables(
    md: &mut String,
    dir: &Path,
    runs: &[Run],
) -> anyhow::Result<Vec<serde_json::Value>> {
    use std::fmt::Write as _;
    let mut json_runs = Vec::new();
    writeln!(md, "\n## Scenarios\n")?;
    for workload in workloads() {
        let mine: Vec<&Run> = runs
            .iter()
            .filter(|r| r.scenario == workload.name)
            .collect();
        let Some(reference) = mine.first().map(|r| r.figures()) else {
            continue;
        };
        writeln!(md, "### {}: {}\n", workload.name, workload.about)?;
        writeln!(
            md,
            "| router | KV hit | oracle | hit / oracle | TTFT p50 | TTFT p99 | req/s | failed | token imbalance | hit vs precise | TTFT p50 vs precise | TTFT p99 vs precise | req/s vs precise |"
        )?;
        writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
        let mut chart_rows = Vec::new();
        for run in &mine {
            let f = run.figures();
            writeln!(
                md,
                "| {} | {:.1}% | {:.1}% | {:.2} | {:.0} ms | {:.0} ms | {:.1} | {} | {:.2} | {} | {} | {} | {} |",
                run.profile,
                f.hit_pct,
                f.oracle_pct,
                f.hit_pct / f.oracle_pct.max(1e-9),
                f.ttft_p50_ms,
                f.ttft_p99_ms,
                f.throughput,
                f.failed,
                f.token_imbalance,
                ratio(f.hit_pct, reference.hit_pct),
                ratio(f.ttft_p50_ms, reference.ttft_p50_ms),
                ratio(f.ttft_p99_ms, reference.ttft_p99_ms),
                ratio(f.throughput, reference.throughput),
            )?;
            chart_rows.push((run.profile.clone(), f.hit_pct, f.oracle_pct));
            json_runs.push(run_json(run));
        }
        let chart = format!("peers/{}.svg", workload.name);
        crate::chart::scenario_chart(
            &dir.join(&chart),
            &format!("{}: KV hit by router", workload.name),
            &chart_rows,
        )?;
        writeln!(md, "\n![{}]({chart})\n", workload.name)?;
    }
    Ok(json_runs)
}

/// Writes `README.md`, `peers.json` and the charts of a run of the workloads alone into
/// `dir` (on real vLLM, or the emulator at another speed): `intro` above the tables, `notes`
/// below. `rounds` holds each round's runs: one round gives a table of its figures per
/// workload, several a table of their medians (see [`median_tables`]). The two-turn
/// reference and the added latency are left to their own pages: the first is `bench
/// seed`'s, the second a property of the routers, measured on the emulator's instant
/// replicas in `peers.md`.
pub fn write_workloads(
    dir: &Path,
    rounds: &[Vec<Run>],
    page: &WorkloadsPage,
    command: &str,
    machine: &str,
) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir.join("peers"))?;
    let mut md = format!("# {}\n\n", page.title);
    writeln!(md, "Command: `{command}`. Machine: {machine}.\n")?;
    md.push_str(&page.intro);
    let results = match rounds {
        [runs] => json!({"command": command, "machine": machine,
                         "scenarios": scenario_tables(&mut md, dir, runs)?}),
        _ => {
            let (medians, each) = median_tables(&mut md, dir, rounds)?;
            json!({"command": command, "machine": machine, "runs": rounds.len(),
                   "medians": medians, "scenarios": each})
        }
    };
    md.push_str(&page.notes);
    std::fs::write(
        dir.join("peers/peers.json"),
        serde_json::to_string_pretty(&results)? + "\n",
    )?;
    std::fs::write(dir.join("README.md"), &md)?;
    Ok(md)
}

/// A run's figures as JSON.
fn run_json(run: &Run) -> serde_json::Value {
    let f = run.figures();
    json!({"workload": run.scenario, "router": run.profile,
           "requests": f.requests, "failed": f.failed, "hit_pct": f.hit_pct,
           "oracle_pct": f.oracle_pct, "ttft_p50_ms": f.ttft_p50_ms,
           "ttft_p99_ms": f.ttft_p99_ms, "throughput": f.throughput,
           "token_imbalance": f.token_imbalance})
}

/// Several runs of one router on one workload, figure by figure.
struct Repeated {
    /// Each run's figures, in run order.
    runs: Vec<scenarios::Figures>,
}

impl Repeated {
    /// The median over the runs of one figure.
    fn median(&self, figure: impl Fn(&scenarios::Figures) -> f64) -> f64 {
        median(self.runs.iter().map(figure).collect())
    }

    /// One figure of every run, as text.
    fn each(&self, figure: impl Fn(&scenarios::Figures) -> f64, digits: usize) -> String {
        let cells: Vec<String> = self
            .runs
            .iter()
            .map(|f| format!("{:.digits$}", figure(f)))
            .collect();
        cells.join(" / ")
    }
}

/// One table and chart per workload of the medians over `rounds` (each figure's median on
/// its own; hit / oracle is the median of each run's ratio), every run's throughput and
/// TTFT p99 beside them, and a line weighing kvaffine precise against the best medians of
/// the routers other than kvaffine's (round robin among them): what issue 16's aims
/// compare.
/// Returns the medians and every run's figures as JSON.
fn median_tables(
    md: &mut String,
    dir: &Path,
    rounds: &[Vec<Run>],
) -> anyhow::Result<(Vec<serde_json::Value>, Vec<serde_json::Value>)> {
    use std::fmt::Write as _;
    let (mut medians, mut each) = (Vec::new(), Vec::new());
    for (r, runs) in rounds.iter().enumerate() {
        for run in runs {
            let mut entry = run_json(run);
            entry["run"] = json!(r + 1);
            each.push(entry);
        }
    }
    writeln!(md, "\n## Scenarios, medians of {} runs\n", rounds.len())?;
    for workload in workloads() {
        let arms: Vec<(Arm, Repeated)> = ARMS
            .iter()
            .filter_map(|arm| {
                let runs: Vec<scenarios::Figures> = rounds
                    .iter()
                    .filter_map(|runs| {
                        runs.iter()
                            .find(|r| r.scenario == workload.name && r.profile == arm.name)
                            .map(Run::figures)
                    })
                    .collect();
                (!runs.is_empty()).then_some((*arm, Repeated { runs }))
            })
            .collect();
        let Some((_, reference)) = arms.iter().find(|(arm, _)| arm.name == ARMS[0].name) else {
            continue;
        };
        let (ref_throughput, ref_p99) = (
            reference.median(|f| f.throughput),
            reference.median(|f| f.ttft_p99_ms),
        );
        writeln!(md, "### {}: {}\n", workload.name, workload.about)?;
        writeln!(
            md,
            "| router | KV hit | oracle | hit / oracle | TTFT p50 | TTFT p99 | TTFT p99, each run | req/s | req/s, each run | failed (all runs) | token imbalance | TTFT p99 vs precise | req/s vs precise |"
        )?;
        writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
        let mut chart_rows = Vec::new();
        for (arm, repeated) in &arms {
            let hit = repeated.median(|f| f.hit_pct);
            let oracle = repeated.median(|f| f.oracle_pct);
            let (p99, throughput) = (
                repeated.median(|f| f.ttft_p99_ms),
                repeated.median(|f| f.throughput),
            );
            let failed: usize = repeated.runs.iter().map(|f| f.failed).sum();
            writeln!(
                md,
                "| {} | {hit:.1}% | {oracle:.1}% | {:.2} | {:.0} ms | {p99:.0} ms | {} | {throughput:.1} | {} | {failed} | {:.2} | {} | {} |",
                arm.name,
                repeated.median(|f| f.hit_pct / f.oracle_pct.max(1e-9)),
                repeated.median(|f| f.ttft_p50_ms),
                repeated.each(|f| f.ttft_p99_ms, 0),
                repeated.each(|f| f.throughput, 1),
                repeated.median(|f| f.token_imbalance),
                ratio(p99, ref_p99),
                ratio(throughput, ref_throughput),
            )?;
            chart_rows.push((arm.name.to_owned(), hit, oracle));
            medians.push(json!({"workload": workload.name, "router": arm.name,
                "runs": repeated.runs.len(), "failed_all_runs": failed, "hit_pct": hit,
                "oracle_pct": oracle, "ttft_p50_ms": repeated.median(|f| f.ttft_p50_ms),
                "ttft_p99_ms": p99, "throughput": throughput,
                "token_imbalance": repeated.median(|f| f.token_imbalance)}));
        }
        let peers = || {
            arms.iter()
                .filter(|(arm, _)| !matches!(arm.router, Router::Kvaffine(_)))
        };
        let best_throughput = peers()
            .map(|(arm, r)| (arm.name, r.median(|f| f.throughput)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let best_p99 = peers()
            .map(|(arm, r)| (arm.name, r.median(|f| f.ttft_p99_ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let (Some((fastest, throughput)), Some((steadiest, p99))) = (best_throughput, best_p99) {
            writeln!(
                md,
                "\nkvaffine precise against the best of the other routers (round robin included), medians: throughput {} of {fastest}'s, TTFT p99 {} of {steadiest}'s.",
                ratio(ref_throughput, throughput),
                ratio(ref_p99, p99),
            )?;
        }
        let chart = format!("peers/{}.svg", workload.name);
        crate::chart::scenario_chart(
            &dir.join(&chart),
            &format!("{}: KV hit by router, medians", workload.name),
            &chart_rows,
        )?;
        writeln!(md, "\n![{}]({chart})\n", workload.name)?;
    }
    Ok((medians, each))
}

/// The words around the tables of a [`write_workloads`] page.
pub struct WorkloadsPage {
    /// The page's heading.
    pub title: &'static str,
    /// What ran, above the tables.
    pub intro: String,
    /// What the run showed, below them.
    pub notes: String,
}

impl WorkloadsPage {
    /// The peers on two real vLLM `version` replicas, described as `replicas`, running
    /// `workloads`.
    pub fn vllm(version: &str, replicas: &str, workloads: &str) -> Self {
        Self {
            title: "kvaffine and the peers on real vLLM",
            intro: include_str!("peers_vllm_intro.md")
                .replace("{{VERSION}}", version)
                .replace("{{REPLICAS}}", replicas)
                .replace("{{WORKLOADS}}", workloads),
            notes: String::new(),
        }
    }

    /// The peers on emulated replicas at `time_scale` rather than the reference's.
    pub fn time_scale(time_scale: f64) -> Self {
        let fill = |text: &str| {
            text.replace("{{TIME_SCALE}}", &time_scale.to_string())
                .replace(
                    "{{PREFILL}}",
                    // The emulator's cold prefill, tokens a second, at that scale.
                    &format!(
                        "{:.0}",
                        1e3 / vllm_emu::engine::TimeModel::default().uncached_ms / time_scale
                    ),
                )
        };
        Self {
            title: "kvaffine and the peers, the emulator at another speed",
            intro: fill(include_str!("peers_time_scale_intro.md")),
            notes: fill(include_str!("peers_time_scale_notes.md")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::TurnResult;

    /// A run of `workload` under `arm`: ten requests, all served, over `seconds`, with
    /// `ttft_ms` each.
    fn run(workload: &str, arm: Arm, seconds: f64, ttft_ms: u64) -> Run {
        let turn = TurnResult {
            ok: true,
            ttft: Duration::from_millis(ttft_ms),
            prompt_tokens: 100,
            cached_tokens: 50,
            oracle_tokens: 50,
            replica: "a".into(),
            reason: "prefix".into(),
            message: serde_json::Value::Null,
        };
        Run {
            scenario: workload.into(),
            profile: arm.name.into(),
            turns: vec![turn; 10],
            wall: Duration::from_secs_f64(seconds),
            replicas: vec!["a".into(), "b".into()],
            replica_tokens: vec![500, 500],
            learned: Vec::new(),
        }
    }

    #[test]
    fn several_runs_are_tabled_by_their_medians_against_the_best_peer() {
        // precise, run by run: 5, 2.5 and 10 req/s, TTFT 300, 100 and 200 ms (so each
        // median is the middle run's, not the first's or the last's); every other router
        // 2.5 req/s and 200 ms, but sglang-router 10 req/s and 400 ms.
        let rounds: Vec<Vec<Run>> = [(2.0, 300), (4.0, 100), (1.0, 200)]
            .iter()
            .map(|&(wall, ttft)| {
                ARMS.iter()
                    .map(|&arm| match arm.router {
                        Router::Kvaffine("/") => run("concurrency", arm, wall, ttft),
                        Router::SglangRouter(_) => run("concurrency", arm, 1.0, 400),
                        _ => run("concurrency", arm, 4.0, 200),
                    })
                    .collect()
            })
            .collect();
        let dir = std::env::temp_dir().join(format!("kvaffine-peers-{}", std::process::id()));
        let page = WorkloadsPage {
            title: "t",
            intro: String::new(),
            notes: String::new(),
        };
        let md = write_workloads(&dir, &rounds, &page, "c", "m").unwrap();
        assert!(md.contains("medians of 3 runs"), "{md}");
        assert!(
            md.contains("| kvaffine precise | 50.0% | 50.0% | 1.00 | 200 ms | 200 ms | 300 / 100 / 200 | 5.0 | 5.0 / 2.5 / 10.0 | 0 |"),
            "{md}"
        );
        assert!(
            md.contains("medians: throughput 0.50x of sglang-router cache_aware's, TTFT p99 1.00x of vllm-router cache_aware's"),
            "{md}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("peers/peers.json")).unwrap())
                .unwrap();
        assert_eq!(json["runs"], 3);
        assert_eq!(json["scenarios"][0]["run"], 1);
        assert_eq!(json["scenarios"][ARMS.len()]["run"], 2);
        assert_eq!(json["medians"].as_array().map(Vec::len), Some(ARMS.len()));
        assert_eq!(
            json["scenarios"].as_array().map(Vec::len),
            Some(3 * ARMS.len())
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
