//! The production scenarios the reference measurement could not show. Each runs every
//! routing profile on a fresh stack (empty caches), through the real gateway, and reports
//! KV hit rate against the oracle (the longest prefix any replica held when the request was
//! sent), TTFT, throughput, load imbalance and failed requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Map, Value, json};
use tokio::sync::watch;
use vllm_emu::rng::XorShift64;

use crate::session::{Oracle, Session, TurnResult, turn};
use crate::vllm::{OracleProcess, VllmProcess};
use crate::{Stack, StackConfig};

/// A routing profile and the route prefix that selects it.
#[derive(Clone, Copy)]
pub struct Profile {
    /// Name in the tables.
    pub name: &'static str,
    /// Route prefix in `envoy/gateway.yaml`.
    pub prefix: &'static str,
    /// Book picks (the filter's `book`).
    pub book: bool,
}

/// The three profiles every scenario compares.
pub const PROFILES: [Profile; 3] = [
    Profile {
        name: "load-only",
        prefix: "/least-request/",
        book: true,
    },
    Profile {
        name: "approximate",
        prefix: "/approximate/",
        book: true,
    },
    Profile {
        name: "precise",
        prefix: "/",
        book: true,
    },
];

/// One scenario run under one profile.
pub struct Run {
    /// Scenario name.
    pub scenario: String,
    /// Profile name (with a variant, e.g. the event lag).
    pub profile: String,
    /// Every request.
    pub turns: Vec<TurnResult>,
    /// Wall time of the workload.
    pub wall: Duration,
    /// Replica addresses.
    pub replicas: Vec<String>,
    /// Prompt tokens each replica was asked for during the run.
    pub replica_tokens: Vec<u64>,
    /// What the gateway's kvaffined had learned of each replica when the workload ended
    /// (`endpoint` and `prefill` of its `/v1/endpoints`): the speeds the last requests
    /// were ranked at. Empty when that daemon did not answer (a scenario that kills it).
    pub learned: Vec<Value>,
}

/// The figures of a run.
pub struct Figures {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Cached prompt tokens / prompt tokens, percent.
    pub hit_pct: f64,
    /// The oracle's cached tokens / prompt tokens, percent.
    pub oracle_pct: f64,
    /// TTFT median.
    pub ttft_p50_ms: f64,
    /// TTFT 99th percentile.
    pub ttft_p99_ms: f64,
    /// Successful requests per second.
    pub throughput: f64,
    /// Most requests on one replica / mean per replica.
    pub imbalance: f64,
    /// Most prompt tokens on one replica / mean per replica (from the replicas' own
    /// counters, so it needs no help from the router).
    pub token_imbalance: f64,
}

impl Run {
    /// Summarises the run.
    pub fn figures(&self) -> Figures {
        let ok: Vec<&TurnResult> = self.turns.iter().filter(|t| t.ok).collect();
        let prompt: u64 = ok.iter().map(|t| t.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|t| t.cached_tokens).sum();
        let oracle: u64 = ok
            .iter()
            .map(|t| t.oracle_tokens.max(t.cached_tokens))
            .sum();
        let mut ttft: Vec<Duration> = ok.iter().map(|t| t.ttft).collect();
        ttft.sort();
        let q = |p: f64| {
            ttft.get(((ttft.len().max(1) - 1) as f64 * p).round() as usize)
                .map_or(0.0, |d| d.as_secs_f64() * 1e3)
        };
        let mut per_replica: HashMap<&str, usize> =
            self.replicas.iter().map(|r| (r.as_str(), 0)).collect();
        for t in &ok {
            *per_replica.entry(t.replica.as_str()).or_default() += 1;
        }
        let max = per_replica.values().copied().max().unwrap_or(0) as f64;
        let mean = ok.len() as f64 / self.replicas.len().max(1) as f64;
        Figures {
            requests: self.turns.len(),
            failed: self.turns.len() - ok.len(),
            hit_pct: 100.0 * cached as f64 / prompt.max(1) as f64,
            oracle_pct: 100.0 * oracle as f64 / prompt.max(1) as f64,
            ttft_p50_ms: q(0.5),
            ttft_p99_ms: q(0.99),
            throughput: ok.len() as f64 / self.wall.as_secs_f64().max(1e-9),
            imbalance: if mean > 0.0 { max / mean } else { 0.0 },
            token_imbalance: {
                let total: u64 = self.replica_tokens.iter().sum();
                let most = self.replica_tokens.iter().copied().max().unwrap_or(0);
                let mean = total as f64 / self.replica_tokens.len().max(1) as f64;
                if mean > 0.0 { most as f64 / mean } else { 0.0 }
            },
        }
    }
}

/// One replica's share of a run.
pub struct ReplicaFigures {
    /// Its address.
    pub replica: String,
    /// Requests it answered.
    pub requests: usize,
    /// Its share of the prompt tokens the replicas were asked for, percent.
    pub token_pct: f64,
    /// TTFT median of its requests.
    pub ttft_p50_ms: f64,
    /// TTFT 99th percentile of its requests.
    pub ttft_p99_ms: f64,
}

/// The columns of [`Run::turns_csv`].
pub const TURNS_CSV_HEADER: &str = "engine,scenario,profile,turn,ok,prompt_tokens,cached_tokens,oracle_tokens,ttft_ms,replica,reason\n";

impl Run {
    /// One CSV line per request, session by session: what decided each figure (the
    /// replica, numbered from 1 as in `replicas`, and the router's reason), so that a miss
    /// can be traced to its pick. Columns as in [`TURNS_CSV_HEADER`].
    pub fn turns_csv(&self, engine: &str) -> String {
        let mut csv = String::new();
        for (i, t) in self.turns.iter().enumerate() {
            let replica = self
                .replicas
                .iter()
                .position(|r| r == &t.replica)
                .map_or_else(String::new, |n| (n + 1).to_string());
            csv.push_str(&format!(
                "{engine},{},{},{i},{},{},{},{},{:.1},{replica},{}\n",
                self.scenario,
                self.profile.replace(',', ";"),
                t.ok,
                t.prompt_tokens,
                t.cached_tokens,
                t.oracle_tokens,
                t.ttft.as_secs_f64() * 1e3,
                t.reason,
            ));
        }
        csv
    }

    /// Each replica's requests, share of the work and TTFT (a mixed fleet's slow replica
    /// should get less work, not worse latency).
    pub fn per_replica(&self) -> Vec<ReplicaFigures> {
        let total: u64 = self.replica_tokens.iter().sum();
        self.replicas
            .iter()
            .zip(&self.replica_tokens)
            .map(|(replica, &tokens)| {
                let mut ttft: Vec<Duration> = self
                    .turns
                    .iter()
                    .filter(|t| t.ok && &t.replica == replica)
                    .map(|t| t.ttft)
                    .collect();
                ttft.sort();
                let q = |p: f64| {
                    ttft.get(((ttft.len().max(1) - 1) as f64 * p).round() as usize)
                        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
                };
                ReplicaFigures {
                    replica: replica.clone(),
                    requests: ttft.len(),
                    token_pct: 100.0 * tokens as f64 / total.max(1) as f64,
                    ttft_p50_ms: q(0.5),
                    ttft_p99_ms: q(0.99),
                }
            })
            .collect()
    }
}

/// Exponential inter-arrival time with mean `mean`.
fn exponential(rng: &mut XorShift64, mean: Duration) -> Duration {
    let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    mean.mul_f64(-u.ln())
}

/// `words` words of text seeded by `seed`: letters only, so about one token each.
pub fn text(words: usize, seed: u64) -> String {
    let mut rng = XorShift64::from_state(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..words)
        .map(|_| {
            let len = 3 + rng.next_u64() % 5;
            (0..len)
                .map(|_| char::from(b'a' + (rng.next_u64() % 26) as u8))
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn tools(n: usize) -> Value {
    json!(
        (0..n)
            .map(|i| json!({"type": "function", "function": {
        "name": format!("tool_{i}"), "description": "look something up",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}))
            .collect::<Vec<_>>()
    )
}

/// Everything one workload needs to send requests.
#[derive(Clone)]
pub struct Ctx {
    /// The gateway URLs of the profile's route, one per gateway, taken in turn.
    pub urls: Vec<String>,
    /// Which URL the next request takes.
    pub next_url: Arc<std::sync::atomic::AtomicUsize>,
    /// Replica addresses (for the oracle).
    pub replicas: Vec<String>,
    /// HTTP client.
    pub client: reqwest::Client,
    /// Send `cache_salt` as text at the start of the conversation instead (for routers
    /// that do not route salted requests by prefix; isolation stays the same).
    pub salt_as_text: bool,
    /// The model name requests carry.
    pub model: String,
    /// Who says what each replica holds.
    pub oracle: Oracle,
}

impl Ctx {
    /// The URL the next request goes to: each gateway in turn.
    pub fn url(&self) -> &str {
        let n = self
            .next_url
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.urls
            .get(n % self.urls.len().max(1))
            .map_or("", String::as_str)
    }
}

async fn sessions_interleaved(ctx: &Ctx, sessions: &mut [Session], rounds: usize) {
    for round in 0..rounds {
        for (i, session) in sessions.iter_mut().enumerate() {
            session
                .step(ctx, &format!("follow-up {round} of {i}"))
                .await;
        }
    }
}

/// Runs sessions concurrently, each starting after an open-loop (Poisson) arrival, and
/// counts every answered turn into `answered` when given.
async fn sessions_open_loop(
    ctx: &Ctx,
    sessions: Vec<Session>,
    turns: usize,
    mean_gap: Duration,
    seed: u64,
    answered: Option<watch::Sender<usize>>,
) -> Vec<Session> {
    let mut rng = XorShift64::from_state(seed | 1);
    let mut handles = Vec::new();
    let mut at = Duration::ZERO;
    let start = tokio::time::Instant::now();
    for (i, mut session) in sessions.into_iter().enumerate() {
        at += exponential(&mut rng, mean_gap);
        let (ctx, answered) = (ctx.clone(), answered.clone());
        handles.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + at).await;
            for step in 0..turns {
                session
                    .step(&ctx, &format!("step {step} of session {i}"))
                    .await;
                if let Some(answered) = &answered {
                    answered.send_modify(|n| *n += 1);
                }
            }
            session
        }));
    }
    let mut out = Vec::new();
    for handle in handles {
        if let Ok(session) = handle.await {
            out.push(session);
        }
    }
    out
}

/// How many of the fault scenarios' 72 turns are answered before the fault: a third, so
/// that every session has opened and two thirds of the turns come after it. The point is
/// one of the workload, not of the clock: a fixed 1.5 s after the start once killed the
/// daemon before its first lookup (vllm-emu, traced with a throwaway patch).
const FAULT_AFTER_TURNS: usize = 24;

/// The fault scenarios' workload, twelve sessions of six turns, with `inject` called once
/// [`FAULT_AFTER_TURNS`] of its turns are answered.
async fn faulted_sessions(
    ctx: &Ctx,
    seed: u64,
    arrivals: u64,
    inject: impl FnOnce(),
) -> anyhow::Result<Vec<TurnResult>> {
    let sessions: Vec<Session> = (0..12)
        .map(|i| {
            Session::new(
                SYSTEM,
                &text(1200, seed + i),
                json!({"cache_salt": format!("f{seed}-{i}")}),
            )
        })
        .collect();
    let (answered, mut progress) = watch::channel(0);
    let inner = ctx.clone();
    let gap = Duration::from_millis(80);
    let run = tokio::spawn(async move {
        sessions_open_loop(&inner, sessions, 6, gap, arrivals, Some(answered)).await
    });
    progress
        .wait_for(|answered| *answered >= FAULT_AFTER_TURNS)
        .await
        .context("the workload ended before its fault was due")?;
    tokio::task::block_in_place(inject);
    Ok(collect(&run.await.context("the workload's task failed")?))
}

/// 32 agent sessions with tool calls, four turns each, Poisson arrivals 60 ms apart: texts
/// seeded from `first_seed`, salts tagged `tag`, arrivals seeded by `arrivals`.
async fn agent_sessions(ctx: &Ctx, tag: &str, first_seed: u64, arrivals: u64) -> Vec<TurnResult> {
    let sessions = (0..32)
        .map(|i| {
            Session::new(
                SYSTEM,
                &text(1200, first_seed + i),
                json!({"cache_salt": format!("{tag}{i}"), "tools": tools(3)}),
            )
        })
        .collect();
    collect(&sessions_open_loop(ctx, sessions, 4, Duration::from_millis(60), arrivals, None).await)
}

fn collect(sessions: &[Session]) -> Vec<TurnResult> {
    sessions.iter().flat_map(|s| s.results.clone()).collect()
}

/// A scenario: its name, how many replicas, extra replica flags, and the workload.
pub struct Scenario {
    /// Name.
    pub name: &'static str,
    /// What it shows.
    pub about: &'static str,
    /// Replicas.
    pub replicas: usize,
    /// Extra flags for every emulated replica.
    pub replica_args: Vec<String>,
    /// How many times slower the first emulated replica runs than the others (a mixed
    /// fleet), whatever the engine's time scale.
    pub slower_first: Option<f64>,
    /// KV cache capacity per replica in tokens, when the scenario limits it.
    pub kv_tokens: Option<usize>,
    /// Extra flags for kvaffined (ranking figures fixed by hand, say).
    pub daemon_args: Vec<String>,
}

/// `scenario` on emulated replicas serving GPT-OSS's attention layout: a sliding-window
/// KV-cache group of [`crate::seed::HYBRID_WINDOW`] tokens beside full attention (real
/// vLLM runs take the hybrid benchmark model instead). A limited cache gets twice the
/// blocks: every token block takes one in each group while it is computed, and vLLM
/// refuses a model length its cache cannot hold in both, so this keeps the
/// full-attention group's room what the single-group run has.
pub fn hybrid(mut scenario: Scenario) -> Scenario {
    scenario.replica_args.extend([
        "--sliding-window".to_owned(),
        crate::seed::HYBRID_WINDOW.to_owned(),
    ]);
    scenario.kv_tokens = scenario.kv_tokens.map(|tokens| tokens * 2);
    scenario
}

/// The emulator's speed in the reference runs: GPT-OSS-20B's latency model at 0.2 of its
/// times (5,115 prefill tokens/s at scale 1, so 25,575 here).
pub const TIME_SCALE: f64 = 0.2;

/// The replicas scenarios run on.
pub enum Engine {
    /// Fresh vllm-emu replicas for every run, with `block_size`-token blocks, at
    /// `time_scale` of the GPT-OSS-20B latency model.
    Emu {
        /// Tokens per block.
        block_size: usize,
        /// The replicas' `--time-scale`.
        time_scale: f64,
    },
    /// Real vLLM replicas (one scenario's): their prefix caches are reset before every
    /// run, and the oracle rebuilds what they hold from their own events.
    Vllm {
        /// The running replicas.
        replicas: Vec<VllmProcess>,
    },
}

impl Engine {
    /// The emulator at the reference shape (16-token blocks) and speed ([`TIME_SCALE`]).
    pub fn emu() -> Self {
        Self::emu_at(TIME_SCALE)
    }

    /// The emulator at the reference shape, its replicas at `time_scale`.
    pub fn emu_at(time_scale: f64) -> Self {
        Self::Emu {
            block_size: 16,
            time_scale,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        match self {
            Self::Emu { block_size, .. } => *block_size,
            Self::Vllm { replicas, .. } => replicas.first().map_or(0, VllmProcess::block_size),
        }
    }

    /// The model name its replicas serve.
    pub fn model(&self) -> &'static str {
        match self {
            Self::Emu { .. } => "emu-model",
            Self::Vllm { .. } => crate::vllm::SERVED_MODEL,
        }
    }
}

const SYSTEM: &str = "You are a careful software agent. Think, then act.";

/// What fronts the replicas in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One gateway, this many kvaffined active-active behind it.
    Daemons(usize),
    /// This many gateways taking the requests in turn (a Service in front of gateway
    /// pods, no session affinity), their kvaffined as `daemons` says.
    Gateways {
        /// Gateways.
        count: usize,
        /// Which kvaffined each gateway asks.
        daemons: GatewayDaemons,
    },
}

/// Which kvaffined each of several gateways asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatewayDaemons {
    /// Each its own, knowing only its own bookings.
    Own,
    /// Each its own, the daemons sharing their bookings (`--peer`).
    Peered,
    /// All the first gateway's: one daemon sees every booking (the reference peering is
    /// measured against).
    Shared,
}

/// Runs `scenario` under `profile` on `engine`; `variant` names a profile variant (lag,
/// booking).
pub fn run(
    engine: &mut Engine,
    scenario: &Scenario,
    profile: Profile,
    variant: &str,
    topology: Topology,
) -> anyhow::Result<Run> {
    run_through(
        engine,
        scenario,
        &format!("{}{variant}", profile.name),
        profile.book,
        topology,
        false,
        |stack| {
            let url = format!(
                "http://{}{}v1/chat/completions",
                stack.gateway, profile.prefix
            );
            Ok((url, ()))
        },
    )
}

/// Prompt tokens each replica has been asked for (`vllm:prefix_cache_queries_total`):
/// where the load went, whichever router sent it. A replica that does not answer counts
/// 0 (it served nothing that can be counted).
pub fn queried_tokens(replicas: &[String]) -> Vec<u64> {
    replicas
        .iter()
        .map(|r| {
            let (_, text) = vllm_emu::harness::http(r, "GET", "/metrics", "");
            text.lines()
                .find(|l| l.starts_with("vllm:prefix_cache_queries_total"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .map_or(0, |v| v as u64)
        })
        .collect()
}

/// The environment variable whose JSON object of filter settings every run's filter takes
/// on top of its profile's (`{"salt_probes": true}`: the same scenarios with another
/// setting, in a run of its own).
pub const FILTER_ENV: &str = "KVAFFINE_BENCH_FILTER";

/// Runs `scenario` on a fresh stack, sending its workload to the chat URL `target` names
/// for that stack (keeping whatever `target` returns alive until the end: a peer router
/// process, for example).
pub fn run_through<T>(
    engine: &mut Engine,
    scenario: &Scenario,
    name: &str,
    book: bool,
    topology: Topology,
    salt_as_text: bool,
    target: impl FnOnce(&Stack) -> anyhow::Result<(String, T)>,
) -> anyhow::Result<Run> {
    let mut filter = json!({"book": book, "timeout_ms": 500});
    // Filter settings to compare, e.g. `{"salt_probes": true}`, over the profiles' own.
    if let Ok(extra) = std::env::var(FILTER_ENV) {
        let extra: Map<String, Value> = serde_json::from_str(&extra)
            .with_context(|| format!("{FILTER_ENV} must be a JSON object of filter settings"))?;
        for (name, value) in extra {
            filter[name] = value;
        }
    }
    let model = engine.model();
    let (daemons, gateways, peers) = match topology {
        Topology::Daemons(daemons) => (daemons, 1, crate::Peers::None),
        Topology::Gateways { count, daemons } => {
            anyhow::ensure!(
                matches!(engine, Engine::Emu { .. }),
                "several gateways run on the emulator only"
            );
            let peers = match daemons {
                GatewayDaemons::Peered => crate::Peers::Peered(crate::peers_file()?),
                GatewayDaemons::Own => crate::Peers::None,
                GatewayDaemons::Shared => crate::Peers::SharedDaemon,
            };
            (1, count, peers)
        }
    };
    let mut others: Vec<Stack> = Vec::new();
    let (mut stack, oracle, oracle_process) = match engine {
        Engine::Emu {
            block_size,
            time_scale,
        } => {
            let mut replica_args: Vec<String> =
                vec!["--time-scale".into(), (*time_scale).to_string()];
            replica_args.extend(scenario.replica_args.iter().cloned());
            if let Some(tokens) = scenario.kv_tokens {
                replica_args.extend([
                    "--num-gpu-blocks".into(),
                    (tokens / *block_size).to_string(),
                ]);
            }
            let config = StackConfig {
                replicas: scenario.replicas,
                block_size: *block_size,
                replica_args,
                per_replica_args: scenario
                    .slower_first
                    .map(|slower| {
                        vec![vec![
                            "--time-scale".into(),
                            (*time_scale * slower).to_string(),
                        ]]
                    })
                    .unwrap_or_default(),
                filter,
                daemon_args: scenario.daemon_args.clone(),
                daemons,
                ..StackConfig::default()
            };
            let mut first = config.clone();
            if let crate::Peers::Peered(file) = &peers {
                first
                    .daemon_args
                    .extend(["--config".to_owned(), file.display().to_string()]);
            }
            let stack = Stack::start(first)?;
            others = crate::more_gateways(&stack, &peers, gateways, &config)?;
            // A fleet in steady state has long been measured; a run of a few seconds
            // would otherwise be routed mostly at the speed assumed before measuring.
            for stack in std::iter::once(&stack).chain(&others) {
                stack.wait_speeds_measured()?;
            }
            (stack, Oracle::Emulator, None)
        }
        Engine::Vllm { replicas } => {
            for replica in replicas.iter() {
                replica.reset_prefix_cache()?;
            }
            let process = OracleProcess::start(replicas)?;
            process.wait_empty()?;
            let first = replicas
                .first()
                .ok_or_else(|| anyhow::anyhow!("no replica"))?;
            let stack = crate::vllm::front(
                replicas,
                StackConfig {
                    filter,
                    daemon_args: scenario.daemon_args.clone(),
                    daemons,
                    ..StackConfig::default()
                },
            )?;
            // As for the emulator above: a fleet in steady state has long been measured.
            stack.learn_prefill_costs(replicas, &process)?;
            let oracle = Oracle::Vllm {
                service: process.addr.clone(),
                render: first.http.clone(),
            };
            (stack, oracle, Some(process))
        }
    };
    let (url, guard) = target(&stack)?;
    let urls = std::iter::once(url.clone())
        .chain(
            others
                .iter()
                .map(|other| url.replacen(&stack.gateway, &other.gateway, 1)),
        )
        .collect();
    let ctx = Ctx {
        urls,
        next_url: Default::default(),
        replicas: stack.upstreams.iter().map(|r| r.http.clone()).collect(),
        client: crate::load::client()?,
        salt_as_text,
        model: model.to_owned(),
        oracle,
    };
    let runtime = crate::load::runtime()?;
    let before = queried_tokens(&ctx.replicas);
    let start = Instant::now();
    let turns = runtime.block_on(workload(scenario.name, &ctx, &mut stack, &mut others))?;
    let wall = start.elapsed();
    let learned = stack
        .endpoints()
        .iter()
        .map(|e| json!({"endpoint": e["endpoint"], "prefill": e["prefill"]}))
        .collect();
    // A counter that went backwards belongs to a restarted replica: all of it is new.
    let replica_tokens = queried_tokens(&ctx.replicas)
        .iter()
        .zip(before)
        .map(|(&after, before)| {
            if after >= before {
                after - before
            } else {
                after
            }
        })
        .collect();
    drop(guard);
    drop(others);
    drop(oracle_process);
    Ok(Run {
        scenario: scenario.name.to_owned(),
        profile: name.to_owned(),
        turns,
        wall,
        replicas: ctx.replicas.clone(),
        replica_tokens,
        learned,
    })
}

async fn workload(
    name: &str,
    ctx: &Ctx,
    stack: &mut Stack,
    others: &mut [Stack],
) -> anyhow::Result<Vec<TurnResult>> {
    Ok(match name {
        "template-divergence" => {
            // One team (one salt) working on the same 2k-token document in sessions whose
            // template inputs differ: tools offered or not, reasoning effort low or high.
            // The text is shared, the tokens are not; sessions overlap in time, so their
            // first turns spread over the replicas.
            let doc = text(2000, 1);
            let sessions: Vec<Session> = (0..16)
                .map(|i| {
                    let mut fields = json!({"cache_salt": "team", "reasoning_effort": if i % 2 == 0 { "low" } else { "high" }});
                    if i % 4 >= 2 {
                        fields["tools"] = tools(2);
                    }
                    Session::new(SYSTEM, &format!("{doc}\nTask {i}: review the document."), fields)
                })
                .collect();
            collect(&sessions_open_loop(ctx, sessions, 3, Duration::from_millis(40), 3, None).await)
        }
        "concurrency" => agent_sessions(ctx, "c", 100, 7).await,
        // The same workload (other sessions) on a fleet whose first replica prefills and
        // decodes at half the speed of the other three.
        "heterogeneous" => agent_sessions(ctx, "h", 900, 29).await,
        "cache-pressure" => {
            // Two replicas of 256 blocks x 16 tokens; twenty ~800-token sessions (about 1,000
            // blocks: twice the fleet), visited with a skew (a few hot, many cold), so what
            // stays cached depends on evictions the router must follow.
            let mut sessions: Vec<Session> = (0..20)
                .map(|i| {
                    Session::new(
                        SYSTEM,
                        &text(800, 200 + i),
                        json!({"cache_salt": format!("p{i}")}),
                    )
                })
                .collect();
            let mut rng = XorShift64::from_state(23);
            for step in 0..60 {
                // Weight 1/(i+1): session 0 is visited ten times as often as session 9.
                let total: f64 = (1..=20).map(|i| 1.0 / f64::from(i)).sum();
                let mut pick = rng.unit() * total;
                let mut i = 0;
                while i < 19 && pick > 1.0 / (i as f64 + 1.0) {
                    pick -= 1.0 / (i as f64 + 1.0);
                    i += 1;
                }
                sessions[i].step(ctx, &format!("step {step}")).await;
            }
            collect(&sessions)
        }
        "branching" => {
            // Three base conversations, then twelve forks from them at different depths.
            let mut bases: Vec<Session> = (0..3)
                .map(|i| {
                    Session::new(
                        SYSTEM,
                        &text(1500, 300 + i),
                        json!({"cache_salt": "shared"}),
                    )
                })
                .collect();
            sessions_interleaved(ctx, &mut bases, 2).await;
            let mut forks: Vec<Session> = (0..12)
                .map(|i| {
                    let base = &bases[i % 3];
                    let keep = base.messages.len() - (i / 3 % 2) * 2;
                    let mut fork = Session::new(SYSTEM, "", base.fields.clone());
                    fork.messages = base.messages[..keep].to_vec();
                    fork.messages.push(json!({"role": "user", "content": format!("branch {i}: try another approach")}));
                    fork
                })
                .collect();
            sessions_interleaved(ctx, &mut forks, 2).await;
            let mut all = collect(&bases);
            all.extend(collect(&forks));
            all
        }
        "event-lag" => {
            // Bursts of siblings: four requests sharing a fresh 1.5k-token prefix, 150 ms apart:
            // after the first one's prefill is done, but (with lag) before its events reach
            // the index.
            let mut results = Vec::new();
            for burst in 0..6u64 {
                let prefix = text(1500, 400 + burst);
                let mut handles = Vec::new();
                for sibling in 0..4u64 {
                    let body = json!({"model": "emu-model", "cache_salt": format!("burst{burst}"), "max_tokens": 8,
                        "messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": format!("{prefix}\nsibling {sibling}")}]});
                    let ctx = ctx.clone();
                    handles.push(tokio::spawn(async move { turn(&ctx, &body).await }));
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                for handle in handles {
                    results.extend(handle.await.ok());
                }
            }
            results
        }
        "daemon-restart" | "daemon-kept" => {
            // Each burst's first request goes through the first gateway; then the second
            // gateway's kvaffined is killed and started again (or not, in daemon-kept), and
            // the siblings go through the second gateway once its Envoy asks the daemon
            // again, all before the first request's events: where they go is what the
            // restarted daemon knows of the first.
            let (Some(first_url), Some(second_url)) = (ctx.urls.first(), ctx.urls.get(1)) else {
                anyhow::bail!("{name} needs two gateways");
            };
            let through = |url: &String| Ctx {
                urls: vec![url.clone()],
                ..ctx.clone()
            };
            let (first, second) = (through(first_url), through(second_url));
            let mut results = Vec::new();
            for burst in 0..6u64 {
                let prefix = text(1500, 700 + burst);
                let body = |sibling: u64| {
                    json!({"cache_salt": format!("restart{burst}"), "max_tokens": 8,
                           "messages": [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": format!("{prefix}\nsibling {sibling}")}]})
                };
                results.push(turn(&first, &body(0)).await);
                if name == "daemon-restart" {
                    let restarted = others.first_mut().context("no second gateway")?;
                    restarted.restart_daemon()?;
                    let by = Instant::now() + Duration::from_secs(10);
                    while !restarted.daemon_in_rotation() {
                        anyhow::ensure!(
                            Instant::now() < by,
                            "the restarted kvaffined never came back"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                for sibling in 1..4 {
                    results.push(turn(&second, &body(sibling)).await);
                }
            }
            results
        }
        "replica-restart" => {
            let replica = stack
                .replicas
                .first_mut()
                .ok_or_else(|| anyhow::anyhow!("replica-restart runs on emulated replicas"))?;
            faulted_sessions(ctx, 500, 11, || replica.restart()).await?
        }
        "daemon-failover" => faulted_sessions(ctx, 600, 13, || stack.kill_daemon()).await?,
        "hot-system-prompt" => {
            // Every session opens with the same 2.5k-token system prompt (one tenant).
            let system = text(2500, 700);
            let sessions = (0..24)
                .map(|i| {
                    Session::new(
                        &system,
                        &format!("question {i}: {}", text(100, 800 + i)),
                        json!({}),
                    )
                })
                .collect();
            collect(
                &sessions_open_loop(ctx, sessions, 3, Duration::from_millis(40), 17, None).await,
            )
        }
        other => anyhow::bail!("unknown scenario {other}"),
    })
}

/// The KV events' delay in [`daemon_restart`]: longer than a daemon takes to restart and
/// its gateway to ask it again (Envoy health-checks it every 0.5 s).
const RESTART_EVENT_LAG_MS: u64 = 3000;

/// Bursts of four siblings sharing a fresh prefix through two gateways, the second's
/// kvaffined restarted after each first request (`restarted`), or not: not among [`all`],
/// it needs two gateways (`bench restart`).
pub fn daemon_restart(restarted: bool) -> Scenario {
    Scenario {
        name: if restarted {
            "daemon-restart"
        } else {
            "daemon-kept"
        },
        about: "a gateway's kvaffined restarted between a fresh prefix's first request and its siblings, KV events delayed",
        replicas: 2,
        replica_args: vec!["--event-lag-ms".into(), RESTART_EVENT_LAG_MS.to_string()],
        slower_first: None,
        kv_tokens: None,
        // A booking outlives the lag: it holds the first request's prefix until its events
        // arrive.
        daemon_args: vec![
            "--booking-ttl-ms".into(),
            (2 * RESTART_EVENT_LAG_MS).to_string(),
        ],
    }
}

/// The scenarios, the eight production ones and a mixed fleet.
pub fn all() -> Vec<Scenario> {
    let plain = |name, about, replicas| Scenario {
        name,
        about,
        replicas,
        replica_args: Vec::new(),
        slower_first: None,
        kv_tokens: None,
        daemon_args: Vec::new(),
    };
    vec![
        plain(
            "template-divergence",
            "one team, one document; tools and reasoning effort differ between sessions and turns, earlier reasoning dropped by the template",
            2,
        ),
        plain(
            "concurrency",
            "32 concurrent agent sessions with tool calls on 4 replicas, Poisson arrivals",
            4,
        ),
        Scenario {
            name: "cache-pressure",
            about: "working set twice the fleet's KV capacity: evictions and BlockRemoved",
            replicas: 2,
            replica_args: Vec::new(),
            slower_first: None,
            // 256 blocks of 16 tokens.
            kv_tokens: Some(4096),
            daemon_args: Vec::new(),
        },
        plain(
            "branching",
            "twelve forks of three shared histories at different depths",
            2,
        ),
        plain(
            "event-lag",
            "bursts of four siblings sharing a fresh prefix, KV events delayed",
            2,
        ),
        plain(
            "replica-restart",
            "a replica killed and restarted in the middle of the run",
            2,
        ),
        plain(
            "daemon-failover",
            "two kvaffined active-active, one killed in the middle of the run",
            2,
        ),
        plain(
            "hot-system-prompt",
            "one 2.5k-token system prompt shared by every session, 4 replicas",
            4,
        ),
        Scenario {
            name: "heterogeneous",
            about: "32 concurrent agent sessions on 4 replicas, one of them twice as slow",
            replicas: 4,
            replica_args: Vec::new(),
            slower_first: Some(2.0),
            kv_tokens: None,
            daemon_args: Vec::new(),
        },
    ]
}
