//! `bench soak`: steady traffic for a long time (ever-new conversations and their
//! continuations, on replicas small enough to evict all along), sampling every bounded
//! structure of the gateway path every 10 s, to show that nothing grows after warm-up and
//! that routing is as good at the end as at the start.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;

use crate::scenarios::Ctx;
use crate::session::{Oracle, Session, TurnResult};
use crate::vllm::{OracleProcess, VllmProcess, VllmSpec};
use crate::{Stack, StackConfig};

/// How often everything is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// Which replicas the soak runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Two vllm-emu replicas, 1,024 blocks of 16 tokens each.
    Emu,
    /// Two real vLLM replicas of the tiny model, 256 blocks of 32 tokens each.
    Vllm,
}

impl Engine {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Emu => "emu",
            Self::Vllm => "vllm",
        }
    }

    /// The least time between one client's turns: the traffic's steady rate.
    fn turn_period(self) -> Duration {
        match self {
            Self::Emu => Duration::from_millis(100),
            Self::Vllm => Duration::from_millis(400),
        }
    }
}

/// Concurrent clients, each running conversation after conversation.
pub const CLIENTS: usize = 4;

/// One sample of everything watched.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// Minutes since the traffic started.
    pub minute: f64,
    /// Resident memory of Envoy (its filter VMs included), MiB.
    pub envoy_rss_mib: f64,
    /// Resident memory of kvaffined, MiB.
    pub daemon_rss_mib: f64,
    /// The filter VMs' linear memory, summed (`kvaffine.vm_memory_bytes`), MiB.
    pub filter_vm_mib: f64,
    /// Digests the filter VMs cache (`kvaffine.digest_cache_blocks`).
    pub digest_blocks: f64,
    /// (block, endpoint) entries in kvaffined's index.
    pub index_entries: f64,
    /// Block keys held by kvaffined's live bookings.
    pub booked_keys: f64,
    /// Envoy's open connections: from clients, and to replicas, tokenizers and kvaffined.
    pub envoy_connections: f64,
    /// kvaffined's open file descriptors (sockets to replicas and gateways included).
    pub daemon_fds: f64,
    /// Turns ended so far, and how many of them failed.
    pub turns: usize,
    /// Failed turns so far.
    pub failed: usize,
}

/// The watched series, as (name, what a sample holds, bounded by).
type Series = (&'static str, fn(&Sample) -> f64, &'static str);

const SERIES: [Series; 9] = [
    (
        "Envoy RSS (MiB)",
        |s| s.envoy_rss_mib,
        "the VMs and Envoy's pools",
    ),
    (
        "kvaffined RSS (MiB)",
        |s| s.daemon_rss_mib,
        "the bound it logs at start",
    ),
    ("filter VMs (MiB)", |s| s.filter_vm_mib, "the digest cache"),
    (
        "digest cache (blocks)",
        |s| s.digest_blocks,
        "65,536 per VM",
    ),
    (
        "index entries",
        |s| s.index_entries,
        "the replicas' KV blocks",
    ),
    (
        "booked keys",
        |s| s.booked_keys,
        "`--max-booked-keys`; TTL 2 s",
    ),
    (
        "Envoy connections",
        |s| s.envoy_connections,
        "clients + pools",
    ),
    ("kvaffined fds", |s| s.daemon_fds, "replicas x sockets"),
    ("failed turns", |s| s.failed as f64, "0"),
];

/// What a soak measured.
pub struct Report {
    /// The engine it ran on.
    pub engine: Engine,
    /// Samples, every [`SAMPLE_EVERY`].
    pub samples: Vec<Sample>,
    /// Every turn, with when it ended (minutes since the start).
    pub turns: Vec<(f64, TurnResult)>,
    /// Blocks each replica could hold.
    pub replica_blocks: usize,
}

fn open_fds(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0.0, |d| d.count() as f64)
}

fn daemon_metric(stack: &Stack, name: &str) -> f64 {
    let (_, text) = vllm_emu::harness::http(&stack.daemon_addr, "GET", "/metrics", "");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn sample(stack: &Stack, started: Instant, turns: &Mutex<Vec<(f64, TurnResult)>>) -> Sample {
    let pid = |name: &str| {
        stack
            .processes()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, pid)| pid)
    };
    let (envoy, daemon) = (pid("envoy"), pid("kvaffined"));
    let (done, failed) = {
        let turns = turns.lock().unwrap_or_else(|e| e.into_inner());
        (turns.len(), turns.iter().filter(|(_, t)| !t.ok).count())
    };
    Sample {
        minute: started.elapsed().as_secs_f64() / 60.0,
        envoy_rss_mib: envoy.map_or(0.0, crate::load::rss_mib),
        daemon_rss_mib: daemon.map_or(0.0, crate::load::rss_mib),
        filter_vm_mib: stack
            .filter_metric("kvaffine.vm_memory_bytes")
            .unwrap_or(0.0)
            / (1024.0 * 1024.0),
        digest_blocks: stack
            .filter_metric("kvaffine.digest_cache_blocks")
            .unwrap_or(0.0),
        index_entries: daemon_metric(stack, "kvaffined_index_entries"),
        booked_keys: daemon_metric(stack, "kvaffined_booked_keys"),
        envoy_connections: [
            "http.gateway.downstream_cx_active",
            "cluster.pool.upstream_cx_active",
            "cluster.tokenizer.upstream_cx_active",
            "cluster.kvaffined.upstream_cx_active",
        ]
        .iter()
        .map(|s| stack.stat(s))
        .sum(),
        daemon_fds: daemon.map_or(0.0, open_fds),
        turns: done,
        failed,
    }
}

/// Tenants: each has its own system prompt, which its conversations share.
const TENANTS: usize = 8;

/// A system prompt the conversation shares with its tenant's others (its blocks are
/// looked up by every first turn), then a first message of its own.
fn conversation(client: usize, n: usize) -> Session {
    let tenant = (client + n) % TENANTS;
    let system: String = (0..120)
        .map(|i| format!("t{tenant}rule{} ", i * 7 % 101))
        .collect();
    let first: String = (0..160)
        .map(|i| format!("c{client}n{n}w{} ", (i * 31 + n * 17) % 997))
        .collect();
    Session::new(&system, &first, json!({}))
}

/// Runs the soak for `minutes` on `engine`.
pub fn run(engine: Engine, minutes: f64) -> anyhow::Result<Report> {
    let (stack, replicas, replica_blocks, oracle_process) = match engine {
        Engine::Emu => {
            let blocks = 1024;
            let stack = Stack::start(StackConfig {
                block_size: 16,
                replica_args: vec![
                    "--time-scale".into(),
                    "0".into(),
                    "--num-gpu-blocks".into(),
                    blocks.to_string(),
                ],
                ..StackConfig::default()
            })?;
            (stack, Vec::new(), blocks, None)
        }
        Engine::Vllm => {
            let blocks = 256;
            let spec = VllmSpec {
                extra_args: vec!["--num-gpu-blocks-override".into(), blocks.to_string()],
                // vLLM refuses a model length its cache cannot hold (with room to spare
                // for its reserved block).
                max_model_len: (blocks - 2) * 32,
                ..VllmSpec::default()
            };
            let replicas = VllmProcess::start_all(&[spec.clone(), spec])?;
            let stack = crate::vllm::front(&replicas, StackConfig::default())?;
            let oracle = OracleProcess::start(&replicas)?;
            (stack, replicas, blocks, Some(oracle))
        }
    };
    let oracle = match (&oracle_process, replicas.first()) {
        (Some(process), Some(replica)) => Oracle::Vllm {
            service: process.addr.clone(),
            render: replica.http.clone(),
        },
        _ => Oracle::Emulator,
    };
    let ctx = Ctx {
        urls: vec![format!("http://{}/v1/chat/completions", stack.gateway)],
        next_url: Default::default(),
        replicas: stack.upstreams.iter().map(|u| u.http.clone()).collect(),
        client: crate::load::client()?,
        salt_as_text: false,
        model: match engine {
            Engine::Emu => "emu-model".to_owned(),
            Engine::Vllm => crate::vllm::SERVED_MODEL.to_owned(),
        },
        oracle,
    };
    let runtime = crate::load::runtime()?;
    let turns: Mutex<Vec<(f64, TurnResult)>> = Mutex::new(Vec::new());
    let samples: Mutex<Vec<Sample>> = Mutex::new(Vec::new());
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(minutes * 60.0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut next = started;
            while next <= deadline {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                let s = sample(&stack, started, &turns);
                eprintln!(
                    "soak {:5.1} min: {} turns ({} failed), index {}, booked {}, envoy {:.0} MiB, kvaffined {:.0} MiB",
                    s.minute,
                    s.turns,
                    s.failed,
                    s.index_entries,
                    s.booked_keys,
                    s.envoy_rss_mib,
                    s.daemon_rss_mib
                );
                samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                next += SAMPLE_EVERY;
            }
        });
        runtime.block_on(async {
            let clients: Vec<_> = (0..CLIENTS)
                .map(|client| {
                    let ctx = ctx.clone();
                    let turns = &turns;
                    async move {
                        let mut n = 0;
                        while Instant::now() < deadline {
                            // One to four turns: ever-new conversations and continuations.
                            let mut session = conversation(client, n);
                            for turn in 0..=(n % 4) {
                                let due = Instant::now() + engine.turn_period();
                                session.step(&ctx, &format!("and then {turn} of {n}")).await;
                                if let Some(result) = session.results.last() {
                                    let at = started.elapsed().as_secs_f64() / 60.0;
                                    turns
                                        .lock()
                                        .unwrap_or_else(|e| e.into_inner())
                                        .push((at, result.clone()));
                                }
                                tokio::time::sleep_until(due.into()).await;
                                if Instant::now() >= deadline {
                                    break;
                                }
                            }
                            n += 1;
                        }
                    }
                })
                .collect();
            futures_util::future::join_all(clients).await;
        });
    });
    drop(stack);
    drop(oracle_process);
    drop(replicas);
    Ok(Report {
        engine,
        samples: samples.into_inner().unwrap_or_else(|e| e.into_inner()),
        turns: turns.into_inner().unwrap_or_else(|e| e.into_inner()),
        replica_blocks,
    })
}

/// Prompt tokens served from cache, and what the oracle said could be, over the turns
/// that ended in `[from, to)` minutes.
fn quality(turns: &[(f64, TurnResult)], from: f64, to: f64) -> (f64, f64, usize) {
    let window: Vec<&TurnResult> = turns
        .iter()
        .filter(|(at, t)| *at >= from && *at < to && t.ok)
        .map(|(_, t)| t)
        .collect();
    let prompt: u64 = window.iter().map(|t| t.prompt_tokens).sum();
    let cached: u64 = window.iter().map(|t| t.cached_tokens).sum();
    let oracle: u64 = window
        .iter()
        .map(|t| t.oracle_tokens.min(t.prompt_tokens))
        .sum();
    let share = |n: u64| 100.0 * n as f64 / prompt.max(1) as f64;
    (share(cached), share(oracle), window.len())
}

fn mean_between(samples: &[Sample], from: f64, to: f64, value: fn(&Sample) -> f64) -> f64 {
    let values: Vec<f64> = samples
        .iter()
        .filter(|s| s.minute >= from && s.minute < to)
        .map(value)
        .collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

impl Report {
    /// The run's length, minutes.
    fn minutes(&self) -> f64 {
        self.samples.last().map_or(0.0, |s| s.minute)
    }

    /// Warm-up and the windows compared: the first and last five minutes (a fifth of
    /// the run each when it is shorter than 25 minutes).
    fn window(&self) -> f64 {
        (self.minutes() / 5.0).min(5.0)
    }

    /// The Markdown report (tables, the verdicts) for `chart`, the SVG beside it.
    pub fn markdown(&self, command: &str, machine: &str, chart: &str) -> anyhow::Result<String> {
        let (total, w) = (self.minutes(), self.window());
        let mut md = String::new();
        writeln!(
            md,
            "{CLIENTS} clients, each running conversation after conversation (one to four streamed turns, at most one turn per {} ms; every conversation opens with one of {TENANTS} tenants' system prompts and a first message of its own), through Envoy with the filter and kvaffined, on two {} replicas holding {} blocks each, so that they evict all along. Sampled every {} s for {total:.1} minutes.\n",
            self.engine.turn_period().as_millis(),
            match self.engine {
                Engine::Emu => "vllm-emu",
                Engine::Vllm => "real vLLM (tiny model)",
            },
            self.replica_blocks,
            SAMPLE_EVERY.as_secs(),
        )?;
        writeln!(md, "Command: `{command}`. Machine: {machine}.\n")?;
        writeln!(
            md,
            "![every series over the run, as a share of its maximum]({chart})\n"
        )?;
        let failed = self.turns.iter().filter(|(_, t)| !t.ok).count();
        writeln!(md, "**{} turns, {failed} failed.**\n", self.turns.len())?;
        writeln!(
            md,
            "| series | bounded by | after warm-up (min {w:.1}-{:.1}) | last {w:.1} min | change |\n|---|---|---|---|---|",
            2.0 * w
        )?;
        for (name, value, bound) in SERIES {
            let early = mean_between(&self.samples, w, 2.0 * w, value);
            let late = mean_between(&self.samples, total - w, total + 1.0, value);
            let change = if early.abs() < f64::EPSILON {
                if late.abs() < f64::EPSILON {
                    "none".to_owned()
                } else {
                    "from 0".to_owned()
                }
            } else {
                format!("{:+.1}%", 100.0 * (late - early) / early)
            };
            writeln!(
                md,
                "| {name} | {bound} | {early:.1} | {late:.1} | {change} |"
            )?;
        }
        let (first_hit, first_oracle, first_n) = quality(&self.turns, 0.0, w);
        let (last_hit, last_oracle, last_n) = quality(&self.turns, total - w, total + 1.0);
        writeln!(
            md,
            "\nRouting quality (prompt tokens the replicas reported served from cache, and what the oracle said the best replica held when each turn was sent):\n\n| window | turns | served from cache | oracle |\n|---|---|---|---|\n| first {w:.1} min | {first_n} | {first_hit:.1}% | {first_oracle:.1}% |\n| last {w:.1} min | {last_n} | {last_hit:.1}% | {last_oracle:.1}% |\n"
        )?;
        writeln!(
            md,
            "| minute | Envoy RSS | kvaffined RSS | filter VMs | digest cache | index entries | booked keys | Envoy conns | kvaffined fds | turns | failed |\n|---|---|---|---|---|---|---|---|---|---|---|"
        )?;
        let every = (self.samples.len() / 12).max(1);
        for (i, s) in self.samples.iter().enumerate() {
            if i % every == 0 || i + 1 == self.samples.len() {
                writeln!(
                    md,
                    "| {:.1} | {:.0} MiB | {:.0} MiB | {:.1} MiB | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |",
                    s.minute,
                    s.envoy_rss_mib,
                    s.daemon_rss_mib,
                    s.filter_vm_mib,
                    s.digest_blocks,
                    s.index_entries,
                    s.booked_keys,
                    s.envoy_connections,
                    s.daemon_fds,
                    s.turns,
                    s.failed
                )?;
            }
        }
        Ok(md)
    }

    /// Every series over time as a share of its own maximum.
    pub fn chart(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let series: Vec<(String, Vec<(f64, f64)>)> = SERIES
            .iter()
            .filter(|(name, _, _)| *name != "failed turns")
            .map(|(name, value, _)| {
                let top = self
                    .samples
                    .iter()
                    .map(value)
                    .fold(0.0f64, f64::max)
                    .max(f64::MIN_POSITIVE);
                (
                    (*name).to_owned(),
                    self.samples
                        .iter()
                        .map(|s| (s.minute, 100.0 * value(s) / top))
                        .collect(),
                )
            })
            .collect();
        crate::chart::lines(
            path,
            &format!(
                "soak on {}: each series as a share of its maximum",
                self.engine.name()
            ),
            "minutes",
            "% of the series' maximum",
            &series,
        )
        .context("cannot draw the soak chart")
    }
}
