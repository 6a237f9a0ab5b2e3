//! `kvaffined check`: asks one vLLM replica how it is configured and says whether kvaffine
//! can compute its keys, before any traffic depends on it.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::Value;

use crate::scrape::parse_metrics;

/// Flags of `kvaffined check`.
#[derive(Args)]
pub struct CheckArgs {
    /// The replica's HTTP address (`http://HOST:PORT` or `HOST:PORT`).
    #[arg(long)]
    endpoint: String,
    /// The block size kvaffine is configured with, to compare (optional).
    #[arg(long)]
    block_size: Option<u64>,
}

/// What the replica says, and whether kvaffine can key it.
#[derive(Debug, PartialEq)]
pub struct Report {
    /// The text printed.
    pub text: String,
    /// False when kvaffine cannot compute this replica's keys as configured.
    pub computable: bool,
}

/// Builds the report from the replica's `/metrics` text and `/kv_event_sources` JSON.
pub fn report(metrics: &str, sources: Option<&Value>, expected_block_size: Option<u64>) -> Report {
    let scrape = parse_metrics(metrics);
    let mut text = String::new();
    let mut computable = true;
    let mut problem = |text: &mut String, line: String| {
        computable = false;
        let _ = writeln!(text, "  PROBLEM: {line}");
    };
    let _ = writeln!(
        text,
        "model: {}",
        scrape.model.as_deref().unwrap_or("(unknown)")
    );
    match scrape.block_size {
        Some(size) => {
            let _ = writeln!(text, "block size: {size}");
            if let Some(expected) = expected_block_size.filter(|e| *e != size) {
                problem(
                    &mut text,
                    format!("kvaffine is configured with --block-size {expected}"),
                );
            }
        }
        None => problem(
            &mut text,
            "no vllm:cache_config_info in /metrics (stats logging off?)".into(),
        ),
    }
    match scrape.hash_algo.as_deref() {
        Some(algo @ ("sha256_cbor" | "xxhash_cbor")) => {
            let _ = writeln!(
                text,
                "prefix caching hash: {algo} (kvaffine computes these keys)"
            );
            if algo == "xxhash_cbor" {
                let _ = writeln!(
                    text,
                    "  note: xxhash_cbor needs the same PYTHONHASHSEED in vLLM and kvaffine (--hash-seed)"
                );
            }
        }
        Some(algo) => problem(
            &mut text,
            format!(
                "prefix caching hash {algo} hashes a Python pickle: kvaffine cannot compute it. The daemon still routes this replica by re-keying its events from their token ids (a hash per block, an engine-hash map in memory, blocks whose parent it missed lost); run vLLM with --prefix-caching-hash-algo sha256_cbor to avoid that"
            ),
        ),
        None => problem(&mut text, "prefix_caching_hash_algo not reported".into()),
    }
    match sources.and_then(Value::as_object) {
        Some(ranks) if !ranks.is_empty() => {
            for (rank, config) in ranks {
                let enabled = config
                    .get("enable_kv_cache_events")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let _ = writeln!(
                    text,
                    "events rank {rank}: {} replay {} topic {:?}{}",
                    config
                        .get("endpoint")
                        .and_then(Value::as_str)
                        .unwrap_or("?"),
                    config
                        .get("replay_endpoint")
                        .and_then(Value::as_str)
                        .unwrap_or("(none: gaps cannot be repaired)"),
                    config.get("topic").and_then(Value::as_str).unwrap_or(""),
                    if enabled { "" } else { " (DISABLED)" }
                );
                if !enabled {
                    problem(&mut text, format!("KV events are disabled on rank {rank}"));
                }
            }
        }
        _ => problem(
            &mut text,
            "no /kv_event_sources (vLLM < 0.31, or events off): configure the endpoints by hand"
                .into(),
        ),
    }
    let _ = writeln!(
        text,
        "{}",
        if computable {
            "OK: kvaffine can route to this replica"
        } else {
            "NOT OK"
        }
    );
    Report { text, computable }
}

fn base_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    if trimmed.starts_with("http://") || trimmed.starts_with("https://") {
        trimmed.to_owned()
    } else {
        format!("http://{trimmed}")
    }
}

/// Runs the check; an error (exit 2) when the replica cannot be keyed or reached.
pub fn run(args: &CheckArgs) -> anyhow::Result<()> {
    let base = base_url(&args.endpoint);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (metrics, sources) = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()?;
        let metrics = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .with_context(|| format!("cannot reach {base}/metrics"))?
            .error_for_status()?
            .text()
            .await?;
        let sources = match client.get(format!("{base}/kv_event_sources")).send().await {
            Ok(response) if response.status().is_success() => response.json::<Value>().await.ok(),
            _ => None,
        };
        anyhow::Ok((metrics, sources))
    })?;
    let report = report(&metrics, sources.as_ref(), args.block_size);
    print!("{}", report.text);
    if !report.computable {
        bail!("{base}: kvaffine cannot compute this replica's keys as configured (see above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const GOOD: &str = r#"vllm:cache_config_info{block_size="64",model_name="m",prefix_caching_hash_algo="sha256_cbor"} 1.0
"#;

    #[test]
    fn a_well_configured_replica_passes() {
        let sources = json!({"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}});
        let report = report(GOOD, Some(&sources), Some(64));
        assert!(report.computable, "{}", report.text);
        assert!(report.text.contains("tcp://*:5557"));
    }

    #[test]
    fn pickle_hashes_other_block_sizes_and_missing_events_fail() {
        let pickle = GOOD.replace("sha256_cbor", "sha256");
        assert!(
            !report(
                &pickle,
                Some(&json!({"0": {"enable_kv_cache_events": true, "endpoint": "x"}})),
                None
            )
            .computable
        );
        assert!(
            !report(
                GOOD,
                Some(&json!({"0": {"enable_kv_cache_events": true, "endpoint": "x"}})),
                Some(16)
            )
            .computable
        );
        assert!(!report(GOOD, None, Some(64)).computable);
        assert!(!report("", None, None).computable);
    }
}
