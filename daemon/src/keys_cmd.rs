//! `kvaffined keys`: vLLM's block keys for a token list, for operators comparing them
//! with what a replica publishes.

use std::io::{Read, Write};

use anyhow::{Context, bail};
use clap::Args;
use kvaffine_core::{CacheSalt, HashAlgo, KeyConfig, KeyExtras, LoraAdapter, VllmCompat};
use serde_json::{Value, json};

/// Flags of `kvaffined keys`; each mirrors the vLLM setting it must equal.
#[derive(Args)]
pub struct KeysArgs {
    /// vLLM's `--block-size`.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// vLLM's `--prefix-caching-hash-algo` (only the CBOR algorithms are reproducible).
    #[arg(long, default_value = "sha256_cbor")]
    hash_algo: HashAlgo,
    /// The replica's `PYTHONHASHSEED`, if set.
    #[arg(long)]
    hash_seed: Option<String>,
    /// The request's `cache_salt`.
    #[arg(long)]
    cache_salt: Option<String>,
    /// The request's LoRA adapter name.
    #[arg(long, requires = "lora_path")]
    lora_name: Option<String>,
    /// The path the replica loaded that adapter from (hashed since vLLM 0.31).
    #[arg(long, requires = "lora_name")]
    lora_path: Option<String>,
    /// Extra-key encoding: 0.31 (tagged, vLLM >= 0.31) or 0.30 (bare, earlier).
    #[arg(long, default_value = "0.31")]
    vllm_compat: VllmCompat,
}

/// Reads the token array from `input` and writes `{"hashes":[{"full","event"}...]}`.
pub fn run(args: &KeysArgs, mut input: impl Read, mut output: impl Write) -> anyhow::Result<()> {
    let cache_salt = args
        .cache_salt
        .as_deref()
        .map(CacheSalt::parse)
        .transpose()
        .context("invalid --cache-salt")?;
    let lora = match (&args.lora_name, &args.lora_path) {
        (Some(name), Some(path)) => Some(LoraAdapter {
            name: name.clone(),
            path: path.clone(),
        }),
        _ => None,
    };
    let config = KeyConfig::new(
        args.hash_algo,
        args.block_size as usize,
        args.hash_seed.as_deref(),
        args.vllm_compat,
    )?;
    let mut text = String::new();
    input
        .read_to_string(&mut text)
        .context("stdin is not UTF-8 text")?;
    let tokens = parse_tokens(&text)?;
    let digests = config.digests(&KeyExtras { lora, cache_salt }, &tokens);
    let hashes: Vec<Value> = digests
        .iter()
        .map(|d| json!({ "full": d.to_hex(), "event": d.block_key().0 }))
        .collect();
    serde_json::to_writer(&mut output, &json!({ "hashes": hashes }))?;
    writeln!(output)?;
    Ok(())
}

/// A JSON array of token ids, each an integer in `0..=u32::MAX` (vLLM token ids).
fn parse_tokens(text: &str) -> anyhow::Result<Vec<u32>> {
    let value: Value = serde_json::from_str(text).context("stdin is not JSON")?;
    let Value::Array(items) = value else {
        bail!("stdin must be a JSON array of token ids");
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(v), _) => u32::try_from(v)
                    .with_context(|| format!("token id {v} at index {i} exceeds {}", u32::MAX)),
                (None, Some(v)) => bail!("token id {v} at index {i} is negative"),
                (None, None) => bail!("token id {n} at index {i} is not an integer"),
            },
            other => bail!("token id at index {i} is not an integer: {other}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_must_be_arrays_of_non_negative_integers() {
        assert_eq!(
            parse_tokens("[0, 1, 4294967295]").unwrap(),
            vec![0, 1, u32::MAX]
        );
        for (bad, why) in [
            ("{}", "JSON array"),
            ("[1, -2]", "negative"),
            ("[1.5]", "not an integer"),
            ("[\"7\"]", "not an integer"),
            ("[4294967296]", "exceeds"),
            ("[1,", "not JSON"),
        ] {
            let err = format!("{:#}", parse_tokens(bad).unwrap_err());
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
