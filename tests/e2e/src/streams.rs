//! One kvaffined following a thousand event streams: real ZMQ publishers on loopback (one
//! process speaking for many, each publisher with its own sockets, sequence and replay)
//! and the real daemon binary. Measures how long it takes to replay every stream and to
//! apply a burst from all of them, and what the daemon holds while it follows them
//! (memory, threads, file descriptors, idle CPU). `bench streams N`; `cargo xtask bench
//! scale` appends its table to `docs/benchmarks/scale.md`.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvaffine_core::events::EventBatch;
use kvaffine_core::{HashAlgo, KeyConfig, VllmCompat};
use vllm_emu::harness::{binary, http, spawn_announcing};
use vllm_emu::publisher::{EventPublisher, PublisherConfig, batch_of, stored_prompt};

const BLOCK_SIZE: usize = 16;
/// Publishers per ZMQ context: each takes four sockets, libzmq allows 1,023 per context.
const PUBLISHERS_PER_CONTEXT: usize = 128;
/// Prompts per batch and blocks per prompt of the live burst.
const PROMPTS: usize = 8;
const BLOCKS: usize = 8;
/// Live batches each stream publishes.
const LIVE_BATCHES: usize = 4;

/// A batch of `prompts` new prompts of `blocks` blocks each, distinct for every `seed`.
fn batch(keys: &KeyConfig, seed: u64, prompts: usize, blocks: usize) -> EventBatch {
    let events = (0..prompts as u64)
        .map(|p| {
            let tokens: Vec<u32> = (0..(blocks * BLOCK_SIZE) as u64)
                .map(|t| ((seed * 1_000_003 + p * 7919 + t * 104_729) % 151_936) as u32)
                .collect();
            stored_prompt(keys, tokens)
        })
        .collect();
    batch_of(events, 0.0)
}

/// `key`'s value in `/proc/{pid}/status` (e.g. `VmRSS`, `Threads`), first number.
fn proc_status(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds the process has used (user + system).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and stime are the
    // 12th and 13th of them.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

/// Block entries the daemon's index holds.
fn indexed(addr: &str) -> u64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .find_map(|l| l.strip_prefix("kvaffined_index_entries "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn wait(what: &str, bound: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > bound {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(start.elapsed())
}

/// Follows `streams` publishers and measures; returns a markdown table.
pub fn run(streams: usize) -> anyhow::Result<String> {
    // The publishers take about five descriptors each, past many hosts' soft limit.
    rlimit::increase_nofile_limit(u64::MAX)?;
    let keys = KeyConfig::new(HashAlgo::Sha256Cbor, BLOCK_SIZE, None, VllmCompat::V0_31)?;
    let contexts: Vec<zmq::Context> = (0..streams.div_ceil(PUBLISHERS_PER_CONTEXT))
        .map(|_| zmq::Context::new())
        .collect();
    let publishers = (0..streams)
        .map(|i| {
            let context = contexts
                .get(i / PUBLISHERS_PER_CONTEXT)
                .context("no context")?;
            Ok(EventPublisher::start(context, PublisherConfig::default())?)
        })
        .collect::<anyhow::Result<Vec<EventPublisher>>>()?;
    // One batch each before the daemon starts: it must replay them all.
    for (i, p) in publishers.iter().enumerate() {
        p.publish(&batch(&keys, i as u64, 1, BLOCKS))?;
    }
    let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--block-size", "16"]
        .map(str::to_owned)
        .to_vec();
    for (i, p) in publishers.iter().enumerate() {
        let replay = p.replay_endpoint().context("publisher without replay")?;
        args.push("--endpoint".into());
        // Names nothing listens on: the scrapers find no metrics, as for replicas whose
        // /metrics is down; the streams are what is measured.
        args.push(format!(
            "127.0.0.1:{}={},{replay}",
            30_000 + i,
            p.endpoint()
        ));
    }
    let started = Instant::now();
    let (mut daemon, line) = spawn_announcing(&binary("kvaffined"), &args, true);
    let pid = daemon.id();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .with_context(|| format!("kvaffined did not start: {line:?}"))?
        .to_owned();
    let replayed_blocks = (streams * BLOCKS) as u64;
    let bound = Duration::from_secs(600);
    wait("every stream replayed", bound, || {
        indexed(&addr) == replayed_blocks
    })?;
    let replayed = started.elapsed();
    let settled_cpu = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(5));
    let idle_cpu = (cpu_seconds(pid) - settled_cpu) / 5.0;
    let rss_idle = proc_status(pid, "VmRSS");
    let threads = proc_status(pid, "Threads");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let live: Vec<EventBatch> = (0..streams * LIVE_BATCHES)
        .map(|b| batch(&keys, (streams + b) as u64, PROMPTS, BLOCKS))
        .collect();
    let live_blocks = (live.len() * PROMPTS * BLOCKS) as u64;
    let cpu_before = cpu_seconds(pid);
    let sent = Instant::now();
    for (b, batch) in live.iter().enumerate() {
        let publisher = publishers.get(b % streams).context("no publisher")?;
        publisher.publish(batch)?;
    }
    let published = sent.elapsed();
    let applied = wait("every live batch applied", bound, || {
        indexed(&addr) == replayed_blocks + live_blocks
    })?;
    let burst_cpu = cpu_seconds(pid) - cpu_before;
    let rss_full = proc_status(pid, "VmRSS");
    let _ = daemon.kill();
    let _ = daemon.wait();

    let mut out = String::new();
    writeln!(
        out,
        "\n| kvaffined following {streams} event streams (real ZMQ publishers on loopback, one process) | |\n|---|---|"
    )?;
    writeln!(
        out,
        "| started to every stream replayed ({streams} x {BLOCKS} blocks published before it started) | {:.2} s |",
        replayed.as_secs_f64()
    )?;
    writeln!(
        out,
        "| CPU while idle (only the scrapers and each stream's poll) | {:.1}% of a core |",
        idle_cpu * 100.0
    )?;
    writeln!(
        out,
        "| resident memory, streams followed, index nearly empty | {:.0} MiB |",
        rss_idle as f64 / 1024.0
    )?;
    writeln!(out, "| threads | {threads} |")?;
    writeln!(out, "| open file descriptors | {fds} |")?;
    writeln!(
        out,
        "| live burst: {} batches of {PROMPTS} x {BLOCKS} blocks, dealt round-robin, published in | {:.2} s |",
        live.len(),
        published.as_secs_f64()
    )?;
    writeln!(
        out,
        "| ... all applied {:.2} s after the first was sent: {:.2} M block entries/s, {:.2} CPU seconds | |",
        applied.as_secs_f64() + published.as_secs_f64(),
        live_blocks as f64 / (applied + published).as_secs_f64() / 1e6,
        burst_cpu
    )?;
    writeln!(
        out,
        "| resident memory after ({} block entries) | {:.0} MiB |",
        replayed_blocks + live_blocks,
        rss_full as f64 / 1024.0
    )?;
    Ok(out)
}
