//! Scraping each replica's `/metrics`: its load, its model, and whether its cache settings
//! are the ones the daemon keys with.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{error, warn};

use crate::speed::PrefillCounters;
use crate::state::{Daemon, Endpoint, ScrapedLoad};

/// What one scrape says about a replica.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    /// Load, summed (requests) or maxed (KV usage) over engines.
    pub load: ScrapedLoad,
    /// `model_name` label of the vLLM series.
    pub model: Option<String>,
    /// `block_size` label of `vllm:cache_config_info`.
    pub block_size: Option<u64>,
    /// `prefix_caching_hash_algo` label of `vllm:cache_config_info`.
    pub hash_algo: Option<String>,
    /// `vllm:prefix_cache_hits_total` (tokens), summed over engines.
    pub prefix_cache_hits: Option<f64>,
    /// Finished requests' prefill time, computed and prompt tokens, summed over engines;
    /// None unless the first three series are there (vLLM 0.24.0 and 0.32.0 export them).
    pub prefill: Option<PrefillCounters>,
}

/// One sample line: name, labels, value.
type Sample<'a> = (&'a str, Vec<(&'a str, String)>, f64);

/// Splits `name{a="b",...} value` into its name, labels and value.
fn sample(line: &str) -> Option<Sample<'_>> {
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.trim().parse().ok()?;
    let Some((name, rest)) = head.split_once('{') else {
        return Some((head.trim(), Vec::new(), value));
    };
    let body = rest.trim_end().strip_suffix('}')?;
    let mut labels = Vec::new();
    let mut chars = body.char_indices();
    let mut start = 0;
    while start < body.len() {
        let eq = body.get(start..)?.find('=')? + start;
        let key = body.get(start..eq)?.trim().trim_start_matches(',').trim();
        let mut value = String::new();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in chars.by_ref() {
            if i <= eq + 1 {
                continue;
            }
            match (escaped, c) {
                (true, c) => {
                    value.push(match c {
                        'n' => '\n',
                        other => other,
                    });
                    escaped = false;
                }
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                (false, c) => value.push(c),
            }
        }
        labels.push((key, value));
        start = end? + 1;
    }
    Some((name, labels, value))
}

fn label<'a>(labels: &'a [(&str, String)], name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
}

/// Reads the series kvaffine uses from a Prometheus text exposition.
pub fn parse_metrics(text: &str) -> Scrape {
    let mut scrape = Scrape::default();
    let (mut requests, mut seconds, mut computed, mut prompt) = (None, None, None, None);
    let add = |sum: &mut Option<f64>, value: f64| *sum.get_or_insert(0.0) += value;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        if scrape.model.is_none() && name.starts_with("vllm:") {
            scrape.model = label(&labels, "model_name").map(str::to_owned);
        }
        match name {
            "vllm:num_requests_running" => scrape.load.running += value as u32,
            "vllm:num_requests_waiting" => scrape.load.waiting += value as u32,
            "vllm:kv_cache_usage_perc" => {
                scrape.load.kv_cache_usage = scrape.load.kv_cache_usage.max(value)
            }
            "vllm:prefix_cache_hits_total" => {
                *scrape.prefix_cache_hits.get_or_insert(0.0) += value;
            }
            "vllm:cache_config_info" => {
                scrape.block_size = label(&labels, "block_size").and_then(|v| v.parse().ok());
                scrape.hash_algo = label(&labels, "prefix_caching_hash_algo").map(str::to_owned);
            }
            "vllm:request_prefill_time_seconds_count" => add(&mut requests, value),
            "vllm:request_prefill_time_seconds_sum" => add(&mut seconds, value),
            "vllm:request_prefill_kv_computed_tokens_sum" => add(&mut computed, value),
            "vllm:request_prompt_tokens_sum" => add(&mut prompt, value),
            _ => {}
        }
    }
    if let (Some(requests), Some(seconds), Some(computed_tokens)) = (requests, seconds, computed) {
        scrape.prefill = Some(PrefillCounters {
            requests,
            seconds,
            computed_tokens,
            prompt_tokens: prompt.unwrap_or(computed_tokens),
        });
    }
    scrape
}

/// Scrapes `endpoint` (`/metrics`, then `/health`) every interval until it is stopped; a
/// replica that does not answer both is unreachable, and ranked after those that do.
pub async fn run(daemon: Arc<Daemon>, endpoint: Arc<Endpoint>, client: reqwest::Client) {
    let url = format!("http://{}/metrics", endpoint.spec.endpoint);
    let health_url = format!("http://{}/health", endpoint.spec.endpoint);
    let timeout = daemon
        .settings
        .scrape_interval
        .max(std::time::Duration::from_millis(200));
    let interval = daemon.settings.scrape_interval;
    // Scraped at once when followed, then at a phase of its own within the interval.
    let phase = interval.mul_f64(crate::discovery::spread(&endpoint.spec.endpoint));
    let followed = std::time::Instant::now();
    let mut first = true;
    while !endpoint.stop.load(Ordering::Relaxed) {
        if !first {
            let now = if daemon.has_peers() {
                since_epoch()
            } else {
                followed.elapsed()
            };
            tokio::time::sleep(until_phase(now, interval, phase)).await;
        }
        first = false;
        // `/metrics` answers as long as the HTTP server lives; `/health` says whether the
        // engine behind it does (vLLM answers 503 once its engine core is dead). Both at
        // once: a slow replica costs one timeout, not two.
        let metrics = async {
            client
                .get(&url)
                .timeout(timeout)
                .send()
                .await?
                .error_for_status()?
                .text()
                .await
        };
        let health = async {
            client
                .get(&health_url)
                .timeout(timeout)
                .send()
                .await?
                .error_for_status()
        };
        let result = tokio::try_join!(metrics, health).map(|(text, _)| text);
        let mut status = endpoint.status.lock();
        match result {
            Ok(text) => {
                let scrape = parse_metrics(&text);
                if status.scrape_error.take().is_some() {
                    tracing::info!(endpoint = %endpoint.spec.endpoint, "metrics and health reachable again");
                }
                // A request that finished between a scrape finding at most one request
                // running or waiting and one finding none may have run alone (or been the
                // last of a burst: the learner checks its time too).
                let busy = |load: &crate::state::ScrapedLoad| load.running + load.waiting;
                let quiet =
                    status.load.is_some_and(|before| busy(&before) <= 1) && busy(&scrape.load) == 0;
                status.load = Some(scrape.load);
                if let Some(prefill) = scrape.prefill {
                    let samples = status.speed.samples();
                    status
                        .speed
                        .observe(prefill, std::time::Instant::now(), quiet);
                    if status.speed.samples() > samples {
                        tracing::debug!(
                            endpoint = %endpoint.spec.endpoint,
                            ?prefill,
                            measured = ?status.speed.measured(),
                            "prefill sample"
                        );
                    }
                }
                if let Some(hits) = scrape.prefix_cache_hits {
                    // From the first scrape on; a counter that went back is a restart.
                    let new = match status.prefix_cache_hits {
                        Some(was) if hits >= was => hits - was,
                        Some(_) => hits,
                        None => 0.0,
                    };
                    daemon
                        .metrics
                        .replica_cache_hits
                        .get_or_create(&endpoint.label)
                        .inc_by(new as u64);
                    status.prefix_cache_hits = Some(hits);
                }
                status.model = scrape.model.clone();
                // What the events showed stands, whatever /metrics says.
                let misconfigured = mismatch(&daemon, &scrape).or_else(|| {
                    status
                        .misconfigured
                        .clone()
                        .filter(|_| status.misconfigured_by_events)
                });
                if misconfigured != status.misconfigured {
                    if let Some(reason) = &misconfigured {
                        error!(endpoint = %endpoint.spec.endpoint, "misconfigured: {reason}");
                    }
                    daemon
                        .metrics
                        .misconfigured
                        .get_or_create(&endpoint.label)
                        .set(i64::from(misconfigured.is_some()));
                    status.misconfigured = misconfigured;
                }
            }
            Err(err) => {
                if status.scrape_error.is_none() {
                    warn!(endpoint = %endpoint.spec.endpoint, "unreachable, ranked after the others: {err}");
                }
                status.scrape_error = Some(err.to_string());
            }
        }
        drop(status);
        daemon.speeds_changed(std::time::Instant::now());
    }
}

/// The wall clock's time since the Unix epoch (zero if it is set before it).
fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// How long from `now` to the next instant `phase` into a period of `interval`, a whole
/// interval if that is now.
///
/// A daemon with peers keeps phases on the wall clock (`now` since the epoch), so peered
/// daemons scrape a replica at the same instants: they see the same requests finish
/// between two scrapes, learn the same prefill speeds and rank alike. One without keeps
/// them from when it began to follow the replica: daemons that do not see each other's
/// picks and read the same loads at the same instants move their sessions off a busy
/// replica together, onto the same one. Measured on the emulator (`bench gateways`,
/// concurrency, 4 gateways): peered, 69.3% hit rate on the wall clock against 64.7% from
/// each start (medians of 15 runs, one gateway 70.9%); unpeered, 59.3% and TTFT p99
/// 586 ms on the wall clock against 74.0% and 174 ms (medians of 5, successive runs).
fn until_phase(
    now: std::time::Duration,
    interval: std::time::Duration,
    phase: std::time::Duration,
) -> std::time::Duration {
    let period = interval.as_nanos().max(1);
    let wait = (phase.as_nanos() % period + period - now.as_nanos() % period) % period;
    let wait = if wait == 0 { period } else { wait };
    std::time::Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX))
}

/// Why the replica's cache settings do not match the daemon's, if they do not.
fn mismatch(daemon: &Daemon, scrape: &Scrape) -> Option<String> {
    let keys = &daemon.settings.keys;
    let mut problems = Vec::new();
    if let Some(size) = scrape.block_size {
        if size != keys.block_size() as u64 {
            problems.push(format!(
                "block_size {size} (the daemon runs with --block-size {})",
                keys.block_size()
            ));
        }
    }
    if let Some(algo) = &scrape.hash_algo {
        if algo != keys.algo().as_str() {
            problems.push(format!(
                "prefix_caching_hash_algo {algo} (the daemon computes {}; events are re-keyed)",
                keys.algo()
            ));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrapes_keep_their_phase_on_the_wall_clock_whenever_the_last_one_ended() {
        let ms = std::time::Duration::from_millis;
        let interval = ms(500);
        let phase = ms(120);
        // Two daemons started apart, and a scrape that ended late, all wait for the same
        // instants: 120 ms into each half second.
        assert_eq!(until_phase(ms(1_000_000), interval, phase), ms(120));
        assert_eq!(until_phase(ms(1_000_007), interval, phase), ms(113));
        assert_eq!(until_phase(ms(1_000_130), interval, phase), ms(490));
        assert_eq!(until_phase(ms(1_000_620), interval, phase), ms(500));
        assert_eq!(until_phase(ms(1_000_619), interval, phase), ms(1));
    }

    #[test]
    fn reads_load_model_and_cache_config_from_vllm_metrics() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.5
vllm:cache_config_info{block_size="64",enable_prefix_caching="True",engine="0",model_name="qwen",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 1234.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen"} 16.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="qwen"} 2.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="qwen"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="qwen"} 0.75
vllm:request_prefill_time_seconds_count{engine="1",model_name="qwen"} 1.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="qwen"} 0.25
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="qwen"} 3.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="qwen"} 6000.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="qwen"} 2000.0
vllm:request_prompt_tokens_sum{engine="0",model_name="qwen"} 9000.0
"#;
        let scrape = parse_metrics(text);
        assert_eq!(
            scrape.load,
            ScrapedLoad {
                running: 5,
                waiting: 4,
                kv_cache_usage: 0.5
            }
        );
        assert_eq!(scrape.model.as_deref(), Some("qwen"));
        assert_eq!(scrape.block_size, Some(64));
        assert_eq!(scrape.hash_algo.as_deref(), Some("sha256_cbor"));
        assert_eq!(scrape.prefix_cache_hits, Some(1250.0));
        assert_eq!(
            scrape.prefill,
            Some(PrefillCounters {
                requests: 4.0,
                seconds: 1.0,
                computed_tokens: 8000.0,
                prompt_tokens: 9000.0
            })
        );
        // An older vLLM without the computed-token histogram teaches nothing.
        let partial: String = text
            .lines()
            .filter(|l| !l.contains("kv_computed"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(parse_metrics(&partial).prefill, None);
    }

    #[test]
    fn label_values_may_hold_escapes_commas_and_braces() {
        let (name, labels, value) = sample(r#"m{a="x,\"y\"}",b="2"} 7"#).unwrap();
        assert_eq!((name, value), ("m", 7.0));
        assert_eq!(
            labels,
            vec![("a", "x,\"y\"}".to_owned()), ("b", "2".to_owned())]
        );
        assert!(sample("garbage").is_none());
        assert_eq!(
            parse_metrics("vllm:num_requests_running{ 1\n"),
            Scrape::default()
        );
    }
}
