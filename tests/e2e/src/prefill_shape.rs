//! What a prompt costs real vLLM to prefill, by how long it is and how much of it is
//! cached, as vLLM itself reports it (`vllm:request_prefill_time_seconds`), beside the
//! linear model kvaffined ranked with before it learned each replica's shape (a cached
//! token at a fixed share of a computed one), an attention model fitted after the fact,
//! and what a kvaffined in front of the replica learned from the same requests. On a CPU
//! replica the cost of a computed token grows with the context it attends over, which the
//! linear model cannot express.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use crate::Stack;
use crate::vllm::{SERVED_MODEL, VllmProcess, VllmSpec};
use kvaffine_core::PrefillSpeed;
use vllm_emu::rng::XorShift64;

/// Cold prompts, in tokens.
const COLD: [usize; 4] = [1024, 2048, 4096, 7168];
/// Cached prefixes, in tokens.
const CACHED: [usize; 2] = [1024, 7168];
/// New tokens sent after each cached prefix.
const NEW: [usize; 5] = [32, 128, 320, 1280, 2560];
/// Requests per row; the row shows their median.
const REPEATS: u64 = 3;

/// One row: `cached` tokens served from the cache, `computed` prefilled, vLLM's prefill
/// time (median of [`REPEATS`] requests, seconds).
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Prompt tokens served from the prefix cache.
    pub cached: f64,
    /// Prompt tokens computed.
    pub computed: f64,
    /// vLLM's prefill time, seconds.
    pub seconds: f64,
}

/// Least squares over rows of (columns, target): the coefficients, or None when the rows do
/// not determine them (a pivot below a billionth of its column's own sum of squares: the
/// columns are scaled alike by that, however far apart their magnitudes).
fn least_squares<const N: usize>(rows: &[([f64; N], f64)]) -> Option<[f64; N]> {
    // The normal equations `a x = b`.
    let mut a = [[0.0; N]; N];
    let mut b = [0.0; N];
    for (x, y) in rows {
        for ((a_row, b_i), x_i) in a.iter_mut().zip(b.iter_mut()).zip(x) {
            *b_i += x_i * y;
            for (cell, x_j) in a_row.iter_mut().zip(x) {
                *cell += x_i * x_j;
            }
        }
    }
    let scale: [f64; N] = std::array::from_fn(|i| a[i][i]);
    // Gaussian elimination with partial pivoting.
    for col in 0..N {
        let pivot = (col..N).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
        if a[pivot][col].abs() <= 1e-9 * scale[col] || a[pivot][col].is_nan() {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (pivot_row, pivot_b) = (a[col], b[col]);
        for row in col + 1..N {
            let factor = a[row][col] / pivot_row[col];
            for (cell, above) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *cell -= factor * above;
            }
            b[row] -= factor * pivot_b;
        }
    }
    let mut x = [0.0; N];
    for row in (0..N).rev() {
        let rest: f64 = a[row].iter().zip(x).skip(row + 1).map(|(a, x)| a * x).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    Some(x)
}

/// The linear model, `t = overhead + (computed + cached_token_cost x cached) / speed`,
/// fitted to `samples` by least squares, or, where that gives a negative fixed cost, with
/// none and the plain ratio of the work to the time (what `daemon/src/speed.rs` falls
/// back to when it has no fixed cost from an earlier fit to keep): the figures, no cost of
/// context among them, and whether it fell back.
pub fn linear_fit(samples: &[Sample], cached_token_cost: f64) -> Option<(PrefillSpeed, bool)> {
    let speed = |overhead: f64, tokens_per_second: f64| PrefillSpeed {
        tokens_per_second,
        overhead_tokens: overhead * tokens_per_second,
        cached_token_cost,
        context_cost: 0.0,
    };
    let work = |s: &Sample| s.computed + cached_token_cost * s.cached;
    let rows: Vec<([f64; 2], f64)> = samples
        .iter()
        .map(|s| ([1.0, work(s)], s.seconds))
        .collect();
    let [overhead, per_token] = least_squares(&rows)?;
    if overhead >= 0.0 && per_token > 0.0 {
        return Some((speed(overhead, 1.0 / per_token), false));
    }
    let (work, seconds): (f64, f64) = samples
        .iter()
        .fold((0.0, 0.0), |(w, t), s| (w + work(s), t + s.seconds));
    (seconds > 0.0).then(|| (speed(0.0, work / seconds), true))
}

/// A model where each computed token attends over the context before it:
/// `t = a + b x computed + e x computed x (cached + computed / 2)`: (a s, b s per token,
/// e s per token pair).
pub fn attention_fit(samples: &[Sample]) -> Option<[f64; 3]> {
    let rows: Vec<([f64; 3], f64)> = samples
        .iter()
        .map(|s| {
            let pairs = s.computed * (s.cached + s.computed / 2.0);
            ([1.0, s.computed, pairs], s.seconds)
        })
        .collect();
    least_squares(&rows)
}

/// Token ids, different per `seed`, inside every test model's vocabulary.
fn ids(seed: u64, n: usize) -> Vec<u64> {
    let mut rng = XorShift64::from_state(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n).map(|_| 1000 + rng.next_u64() % 40_000).collect()
}

/// vLLM's prefill-time histogram so far: (requests, seconds).
fn prefill_seconds(replica: &VllmProcess) -> anyhow::Result<(f64, f64)> {
    let (status, text) = vllm_emu::harness::http(&replica.http, "GET", "/metrics", "");
    anyhow::ensure!(status == 200, "/metrics: {status}");
    let read = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
            })
            .with_context(|| format!("no {name} in /metrics"))
    };
    Ok((
        read("vllm:request_prefill_time_seconds_count")?,
        read("vllm:request_prefill_time_seconds_sum")?,
    ))
}

/// Sends `prompt` (token ids, one output token); returns the tokens vLLM served from its
/// cache and the prefill seconds it reported for it. Requests go one at a time and vLLM
/// 0.32.0 records the histogram before it answers, so it moves by this request alone;
/// fails if it did not move by exactly one request.
fn prefill(replica: &VllmProcess, prompt: &[u64]) -> anyhow::Result<(u64, f64)> {
    let (requests_before, seconds_before) = prefill_seconds(replica)?;
    let (status, body) = replica.post(
        "/v1/completions",
        &json!({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}),
    );
    anyhow::ensure!(status == 200, "/v1/completions: {status} {body}");
    let cached = body
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(serde_json::Value::as_u64)
        .context("no usage.prompt_tokens_details.cached_tokens in vLLM's answer")?;
    let (requests, seconds) = prefill_seconds(replica)?;
    anyhow::ensure!(
        requests - requests_before == 1.0 && seconds > seconds_before,
        "the prefill histogram moved by {} requests and {} s for one request",
        requests - requests_before,
        seconds - seconds_before
    );
    Ok((cached, seconds - seconds_before))
}

/// The prompts to measure: cold ones, and new tokens after each cached prefix.
#[derive(Clone, Copy, Debug)]
pub struct Shapes<'a> {
    /// Cold prompts, in tokens.
    pub cold: &'a [usize],
    /// Cached prefixes, in tokens.
    pub cached: &'a [usize],
    /// New tokens sent after each cached prefix.
    pub new: &'a [usize],
    /// Requests per row; the row is their median.
    pub repeats: u64,
}

/// The page's shapes.
const PAGE: Shapes<'static> = Shapes {
    cold: &COLD,
    cached: &CACHED,
    new: &NEW,
    repeats: REPEATS,
};

/// The median prefill of `repeats` prompts of `prefix` (cached already, or empty) and `new`
/// more tokens; fails unless vLLM served exactly the prefix from its cache. `after` runs
/// after each request.
fn row(
    replica: &VllmProcess,
    (prefix, new, repeats): (&[u64], usize, u64),
    seed: u64,
    after: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Sample> {
    let mut seconds = Vec::new();
    for repeat in 0..repeats {
        let mut prompt = prefix.to_vec();
        prompt.extend(ids(seed * 16 + repeat, new));
        let (cached, took) = prefill(replica, &prompt)?;
        after()?;
        anyhow::ensure!(
            cached == prefix.len() as u64,
            "vLLM served {cached} tokens from cache, not the {}-token prefix",
            prefix.len()
        );
        seconds.push(took);
    }
    anyhow::ensure!(!seconds.is_empty(), "no request");
    Ok(Sample {
        cached: prefix.len() as f64,
        computed: new as f64,
        seconds: crate::load::median(seconds),
    })
}

/// Measures `shapes` on `replica`, one request at a time, row by row; `after` runs after
/// each request (and after each prefix is cached), so a caller can wait for kvaffined to
/// have scraped it. `seed` keeps different callers' prompts apart.
pub fn measure_on(
    replica: &VllmProcess,
    shapes: Shapes,
    seed: u64,
    after: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for (i, &n) in shapes.cold.iter().enumerate() {
        let at = seed + 100 + i as u64;
        samples.push(row(replica, (&[], n, shapes.repeats), at, after)?);
    }
    for (i, &cached) in shapes.cached.iter().enumerate() {
        let prefix = ids(seed + 200 + i as u64, cached);
        prefill(replica, &prefix)?;
        after()?;
        for (j, &new) in shapes.new.iter().enumerate() {
            let at = seed + 300 + (i * shapes.new.len() + j) as u64;
            samples.push(row(replica, (&prefix, new, shapes.repeats), at, after)?);
        }
    }
    Ok(samples)
}

/// Waits, after each request, until kvaffined has scraped `endpoint` once more since the
/// last call: each of its samples is then one request, exactly.
pub fn scraped_by<'a>(
    stack: &'a Stack,
    endpoint: &'a str,
) -> impl FnMut() -> anyhow::Result<()> + 'a {
    let samples = move || {
        stack
            .endpoint(endpoint)
            .and_then(|e| e["prefill"]["samples"].as_u64())
    };
    let mut seen = samples().unwrap_or(0);
    move || {
        crate::poll(
            "kvaffined to scrape the request",
            Duration::from_secs(10),
            || samples().is_some_and(|now| now > seen),
        )?;
        seen = samples().unwrap_or(seen);
        Ok(())
    }
}

/// What kvaffined measured of a replica, from its `/v1/endpoints` entry's `prefill`.
pub fn measured_speed(prefill: &serde_json::Value) -> anyhow::Result<PrefillSpeed> {
    let figure = |field: &str| {
        prefill[field]
            .as_f64()
            .with_context(|| format!("no {field}: {prefill}"))
    };
    let tokens_per_second = figure("measured_tokens_per_second")?;
    Ok(PrefillSpeed {
        tokens_per_second,
        overhead_tokens: figure("measured_overhead_ms")? / 1e3 * tokens_per_second,
        cached_token_cost: figure("measured_cached_token_cost")?,
        context_cost: figure("measured_context_cost")?,
    })
}

/// One replica of the model in `dir` (the vLLM home's models) behind a kvaffined, measured
/// row by row, one request at a time, each scraped by kvaffined before the next: the rows,
/// and what kvaffined learned from them.
pub fn measure(dir: &str) -> anyhow::Result<(Vec<Sample>, PrefillSpeed)> {
    let spec = VllmSpec {
        model: dir.to_owned(),
        max_model_len: 16_384,
        ..VllmSpec::default()
    };
    let replicas = VllmProcess::start_all(&[spec])?;
    let replica = replicas.first().context("no replica")?;
    // The first requests of a fresh process are its slowest.
    for warm in 0..3 {
        prefill(replica, &ids(1 + warm, 512))?;
    }
    let stack = crate::vllm::front(&replicas, crate::StackConfig::default())?;
    stack.wait_scraped()?;
    let started = Instant::now();
    let samples = measure_on(replica, PAGE, 0, &mut scraped_by(&stack, &replica.http))?;
    eprintln!(
        "prefill shape: {dir} measured in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let entry = stack
        .endpoint(&replica.http)
        .context("the replica is not in kvaffined's /v1/endpoints")?;
    Ok((samples, measured_speed(&entry["prefill"])?))
}

/// The page's table for one model: each row measured, and what each model fitted to all
/// rows predicts for it.
pub fn table(
    model: &str,
    samples: &[Sample],
    cached_token_cost: f64,
    learned: &PrefillSpeed,
) -> anyhow::Result<String> {
    let (fitted, fell_back) =
        linear_fit(samples, cached_token_cost).context("the linear model does not fit")?;
    let [a, b, e] = attention_fit(samples).context("the attention model does not fit")?;
    let linear = |s: &Sample| fitted.request_seconds(s.computed, s.cached);
    let attention =
        |s: &Sample| a + b * s.computed + e * s.computed * (s.cached + s.computed / 2.0);
    let by_kvaffined = |s: &Sample| learned.request_seconds(s.computed, s.cached);
    let error = |predicted: f64, s: &Sample| (predicted / s.seconds - 1.0) * 100.0;
    let mut out = format!(
        "**{model}**: the linear model over every row: {:.0} tokens/s after {:.1} ms{}, \
         a cached token at {cached_token_cost} of a computed one. The attention model: \
         {:.1} ms, then {:.3} ms per computed token plus {:.2} ns per token of context it \
         attends over. kvaffined learned {:.0} tokens/s after {:.1} ms, a cached token at \
         {:.3} of a computed one, and {:.2} ns per token of context (a computed token's \
         cost times {:.2e} per token).\n\n\
         | cached tokens | computed tokens | vLLM's prefill | linear model | error | attention model | error | kvaffined learned | error |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        fitted.tokens_per_second,
        fitted.seconds(fitted.overhead_tokens) * 1e3,
        if fell_back {
            " (least squares gave a negative fixed cost: none, and the work over the time)"
        } else {
            " (least squares)"
        },
        a * 1e3,
        b * 1e3,
        e * 1e9,
        learned.tokens_per_second,
        learned.seconds(learned.overhead_tokens) * 1e3,
        learned.cached_token_cost,
        learned.seconds(learned.context_cost) * 1e9,
        learned.context_cost,
    );
    for s in samples {
        out.push_str(&format!(
            "| {:.0} | {:.0} | {:.1} ms | {:.1} ms | {:+.0}% | {:.1} ms | {:+.0}% | {:.1} ms | {:+.0}% |\n",
            s.cached,
            s.computed,
            s.seconds * 1e3,
            linear(s) * 1e3,
            error(linear(s), s),
            attention(s) * 1e3,
            error(attention(s), s),
            by_kvaffined(s) * 1e3,
            error(by_kvaffined(s), s),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(cached: f64, computed: f64, seconds: f64) -> Sample {
        Sample {
            cached,
            computed,
            seconds,
        }
    }

    #[test]
    fn each_model_recovers_the_figures_it_was_made_from() {
        let linear: Vec<Sample> = [(0.0, 1000.0), (0.0, 4000.0), (7000.0, 300.0)]
            .iter()
            .map(|&(c, k)| sample(c, k, 0.02 + (k + 0.1 * c) / 5000.0))
            .collect();
        let (speed, fell_back) = linear_fit(&linear, 0.1).unwrap();
        assert!(!fell_back);
        assert!(
            (speed.seconds(speed.overhead_tokens) - 0.02).abs() < 1e-9,
            "{speed:?}"
        );
        assert!((speed.tokens_per_second - 5000.0).abs() < 1e-6, "{speed:?}");
        let quadratic: Vec<Sample> = [
            (0.0, 1000.0),
            (0.0, 7000.0),
            (7000.0, 32.0),
            (1000.0, 1280.0),
        ]
        .iter()
        .map(|&(c, k)| sample(c, k, 0.03 + 2e-4 * k + 8e-8 * k * (c + k / 2.0)))
        .collect();
        let [a, b, e] = attention_fit(&quadratic).unwrap();
        let close = |got: f64, want: f64| (got / want - 1.0).abs() < 1e-6;
        assert!(
            close(a, 0.03) && close(b, 2e-4) && close(e, 8e-8),
            "{a} {b} {e}"
        );
    }

    #[test]
    fn rows_that_cannot_tell_the_figures_apart_fit_nothing() {
        let same = vec![sample(0.0, 1000.1, 0.2); 3];
        assert_eq!(linear_fit(&same, 0.1), None);
        assert_eq!(attention_fit(&same), None);
    }
}
