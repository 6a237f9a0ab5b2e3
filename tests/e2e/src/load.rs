//! A closed-loop load generator over keep-alive HTTP/1.1 connections, and the statistics
//! the benchmarks report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Latencies of one run, sorted.
#[derive(Clone, Debug, Default)]
pub struct Latencies(pub Vec<Duration>);

impl Latencies {
    /// The `p`-quantile (0-1), nearest rank.
    pub fn quantile(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
        self.0[i.min(self.0.len() - 1)]
    }

    /// Adds another run's samples.
    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
        self.0.sort();
    }
}

/// The median of `values` (the upper one of an even count; NaN if none).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Milliseconds, for tables.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The body of the `n`th request of a run.
pub type Bodies = Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync>;

/// The runtime every load generator here drives its requests on: two workers, as the
/// machine has two cores.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// A client that keeps enough idle connections for the concurrencies measured here.
pub fn client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()
}

/// The same body for every request.
pub fn same(body: Vec<u8>) -> Bodies {
    Arc::new(move |_| body.clone())
}

/// `template` with the 12 bytes of `SALTXXXXXXXX` replaced by the request number: a new
/// `cache_salt` per request, so no block is ever seen twice.
pub fn fresh_salts(template: Vec<u8>, run: usize) -> Bodies {
    let at = template.windows(12).position(|w| w == b"SALTXXXXXXXX");
    Arc::new(move |n| {
        let mut body = template.clone();
        if let Some(at) = at {
            let stamp = format!("{:04}{:08}", run % 10_000, n % 100_000_000);
            body[at..at + 12].copy_from_slice(stamp.as_bytes());
        }
        body
    })
}

/// Sends `total` POSTs to `url` from `concurrency` workers, each waiting for its answer
/// before sending the next. Returns the latencies of successful requests and the number of
/// failures (non-2xx or transport errors).
pub async fn closed_loop(
    client: &reqwest::Client,
    url: &str,
    bodies: Bodies,
    total: usize,
    concurrency: usize,
) -> (Latencies, usize) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (client, url, bodies, next) =
            (client.clone(), url.to_owned(), bodies.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut times = Vec::new();
            let mut failures = 0;
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let body = bodies(n);
                let start = Instant::now();
                let result = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                match result {
                    Ok(response) if response.status().is_success() => {
                        if response.bytes().await.is_ok() {
                            times.push(start.elapsed());
                        } else {
                            failures += 1;
                        }
                    }
                    _ => failures += 1,
                }
            }
            (times, failures)
        }));
    }
    let mut all = Vec::new();
    let mut failures = 0;
    for worker in workers {
        if let Ok((times, failed)) = worker.await {
            all.extend(times);
            failures += failed;
        }
    }
    all.sort();
    (Latencies(all), failures)
}

/// CPU seconds a process's live threads have used, in nanoseconds of resolution: the sum
/// of `/proc/<pid>/task/*/schedstat` (the ticks of `/proc/<pid>/stat` are 10 ms, too
/// coarse for per-request figures over a few hundred requests). Falls back to the ticks
/// where schedstat is missing.
pub fn cpu_seconds(pid: u32) -> f64 {
    let from_schedstat = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()
        .map(|tasks| {
            tasks
                .flatten()
                .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
                .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .filter(|&ns| ns > 0);
    match from_schedstat {
        Some(ns) => ns as f64 / 1e9,
        None => cpu_seconds_from_ticks(pid),
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat` (10 ms ticks).
fn cpu_seconds_from_ticks(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // USER_HZ is 100 on Linux for every architecture this runs on.
    (ticks(11) + ticks(12)) / 100.0
}

/// A chat body whose user message is about `bytes` of English-like prose (a real BPE
/// packs it at about one token per word, as it packs English).
pub fn prose_body(bytes: usize, salt: &str) -> Value {
    const WORDS: [&str; 24] = [
        "the", "request", "carries", "its", "whole", "history", "so", "a", "replica", "that",
        "holds", "cache", "answers", "quickly", "while", "another", "must", "compute", "every",
        "token", "again", "from", "scratch", "today",
    ];
    let mut text = String::with_capacity(bytes + 16);
    let mut i = 0usize;
    while text.len() < bytes {
        text.push_str(WORDS[(i * 7919 + i / 24) % WORDS.len()]);
        text.push(if i % 17 == 16 { '.' } else { ' ' });
        if i % 17 == 16 {
            text.push(' ');
        }
        i += 1;
    }
    one_turn(text, salt)
}

/// A chat request of one user message asking for one token.
fn one_turn(text: String, salt: &str) -> Value {
    serde_json::json!({
        "model": "emu-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "cache_salt": salt,
    })
}

/// A chat body whose user message is about `bytes` of digit-heavy words.
pub fn chat_body(bytes: usize, salt: &str) -> Value {
    let mut text = String::with_capacity(bytes + 16);
    let mut i = 0usize;
    while text.len() < bytes {
        text.push_str(&format!("w{} ", (i * 7919) % 9973));
        i += 1;
    }
    one_turn(text, salt)
}

/// A process's resident memory, MiB (0 once it is gone).
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
