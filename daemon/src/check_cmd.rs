//! `kvaffined check`: asks one vLLM replica how it is configured and says whether kvaffine
//! can compute its keys, before any traffic depends on it.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::Value;

use crate::hybrid::{Layout, Rule};
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

/// Builds the report from the replica's `/metrics` text, its `/kv_event_sources` JSON and
/// the KV-cache groups its buffered events name (or why they could not be read).
pub fn report(
    metrics: &str,
    sources: Option<&Value>,
    expected_block_size: Option<u64>,
    groups: Result<&Layout, &str>,
) -> Report {
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
    match groups {
        Ok(layout) if layout.groups().is_empty() => {
            let _ = writeln!(
                text,
                "KV-cache groups: none published yet (its replay buffer is empty: run check again after it has served a request)"
            );
        }
        Ok(layout) => {
            for g in layout.groups() {
                let _ = writeln!(
                    text,
                    "KV-cache group {}: {}{}, block size {}",
                    g.group,
                    g.kind,
                    g.sliding_window
                        .map_or(String::new(), |w| format!(" (window {w} tokens)")),
                    g.block_size
                );
            }
            let block_size = expected_block_size
                .or(scrape.block_size)
                .or_else(|| layout.groups().first().map(|g| g.block_size))
                .unwrap_or(0);
            match layout.rule(block_size) {
                Rule::Unsupported(why) => problem(&mut text, why),
                Rule::Hybrid { windows, .. } => {
                    let _ = writeln!(
                        text,
                        "  hybrid attention: a hit needs each sliding-window group's last {} block(s) before it; kvaffine predicts that",
                        windows.iter().map(|(_, n)| *n).max().unwrap_or(0)
                    );
                }
                Rule::Prefix(_) => {}
            }
        }
        Err(why) => {
            let _ = writeln!(text, "KV-cache groups: not read ({why})");
        }
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
    let groups = groups_of(&args.endpoint, sources.as_ref());
    let report = report(
        &metrics,
        sources.as_ref(),
        args.block_size,
        groups.as_ref().map_err(String::as_str),
    );
    print!("{}", report.text);
    if !report.computable {
        bail!("{base}: kvaffine cannot compute this replica's keys as configured (see above)");
    }
    Ok(())
}

/// The KV-cache groups the replica's buffered events name, read from its first rank's
/// replay socket (groups are learned from events: vLLM's metrics do not name them).
fn groups_of(endpoint: &str, sources: Option<&Value>) -> Result<Layout, String> {
    let sources = sources.ok_or("no /kv_event_sources")?;
    let sources: std::collections::BTreeMap<String, crate::discovery::EventSource> =
        serde_json::from_value(sources.clone()).map_err(|e| e.to_string())?;
    let host = endpoint
        .trim_end_matches('/')
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    let specs = crate::discovery::resolve_sources(host, &sources).map_err(|e| format!("{e:#}"))?;
    let replay = specs
        .iter()
        .find_map(|s| s.replay.clone())
        .ok_or("no replay endpoint")?;
    let context = zmq::Context::new();
    let dealer = context.socket(zmq::DEALER).map_err(|e| e.to_string())?;
    dealer.set_rcvtimeo(2000).map_err(|e| e.to_string())?;
    dealer.set_linger(0).map_err(|e| e.to_string())?;
    dealer.connect(&replay).map_err(|e| e.to_string())?;
    let request = kvaffine_core::events::replay_request(0);
    dealer
        .send_multipart(request.iter().map(Vec::as_slice), 0)
        .map_err(|e| e.to_string())?;
    let mut layout = Layout::default();
    loop {
        let frames = dealer
            .recv_multipart(0)
            .map_err(|e| format!("{replay} did not answer a replay request: {e}"))?;
        match kvaffine_core::events::parse_replay(&frames).map_err(|e| e.to_string())? {
            kvaffine_core::events::ReplayMessage::End => return Ok(layout),
            kvaffine_core::events::ReplayMessage::Batch { payload, .. } => {
                let batch =
                    kvaffine_core::events::decode_batch(payload).map_err(|e| e.to_string())?;
                for event in &batch.events {
                    if let kvaffine_core::events::KvEvent::BlockStored(s) = event {
                        layout.learn_store(s);
                    }
                }
            }
        }
    }
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
        let report = report(GOOD, Some(&sources), Some(64), Ok(&Layout::default()));
        assert!(report.computable, "{}", report.text);
        assert!(report.text.contains("tcp://*:5557"));
    }

    #[test]
    fn hybrid_groups_are_shown_and_unknown_kinds_fail() {
        let sources = json!({"0": {"enable_kv_cache_events": true, "endpoint": "x"}});
        let mut gemma = Layout::default();
        gemma.learn(0, Some("sliding_window"), Some(128), 64);
        gemma.learn(1, Some("full_attention"), None, 64);
        let hybrid = report(GOOD, Some(&sources), None, Ok(&gemma));
        assert!(hybrid.computable, "{}", hybrid.text);
        assert!(
            hybrid
                .text
                .contains("KV-cache group 0: sliding_window (window 128 tokens), block size 64"),
            "{}",
            hybrid.text
        );
        assert!(hybrid.text.contains("last 2 block(s)"), "{}", hybrid.text);
        gemma.learn(2, Some("mamba"), None, 64);
        let mamba = report(GOOD, Some(&sources), None, Ok(&gemma));
        assert!(!mamba.computable, "{}", mamba.text);
        assert!(mamba.text.contains("mamba"), "{}", mamba.text);
    }

    #[test]
    fn pickle_hashes_other_block_sizes_and_missing_events_fail() {
        let pickle = GOOD.replace("sha256_cbor", "sha256");
        assert!(
            !report(
                &pickle,
                Some(&json!({"0": {"enable_kv_cache_events": true, "endpoint": "x"}})),
                None,
                Ok(&Layout::default())
            )
            .computable
        );
        assert!(
            !report(
                GOOD,
                Some(&json!({"0": {"enable_kv_cache_events": true, "endpoint": "x"}})),
                Some(16),
                Ok(&Layout::default())
            )
            .computable
        );
        assert!(!report(GOOD, None, Some(64), Err("no sources")).computable);
        assert!(!report("", None, None, Err("no sources")).computable);
    }
}
