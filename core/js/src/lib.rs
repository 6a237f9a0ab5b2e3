//! vLLM's prefix-cache block keys for JavaScript: `kvaffine-core`'s own key code, exported
//! through wasm-bindgen, so a Node service or a browser page (the kvaffined console) keys
//! tokens exactly as the filter and `kvaffined keys` do.
//!
//! The one export, `blockKeys(tokenIds, options)`, answers what `kvaffined keys` prints for
//! the same input: `{hashes: [{full, event}]}`, `full` the digest in hex and `event` the
//! KV-event key as a decimal string (it exceeds 2^53, past what a JS number holds).

use kvaffine_core::{CacheSalt, HashAlgo, KeyConfig, KeyExtras, LoraAdapter, VllmCompat};
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

/// The options of `blockKeys`, named as `kvaffined keys` names its flags.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct Options {
    /// vLLM's `--block-size`.
    pub block_size: Option<u32>,
    /// vLLM's `--prefix-caching-hash-algo`; `sha256_cbor` when absent.
    pub hash_algo: Option<String>,
    /// The replica's `PYTHONHASHSEED`, if set.
    pub hash_seed: Option<String>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// The request's LoRA adapter name (needs `loraPath`).
    pub lora_name: Option<String>,
    /// The path the replica loaded that adapter from.
    pub lora_path: Option<String>,
    /// Extra-key encoding: `"0.31"` (vLLM >= 0.31, the default) or `"0.30"`.
    pub vllm_compat: Option<String>,
}

/// One block's key, as `kvaffined keys` prints it (with `event` as a string).
#[derive(Serialize, Debug, PartialEq, Eq)]
pub struct Hash {
    /// The full digest, lowercase hex.
    pub full: String,
    /// The key vLLM's KV events carry (the digest's last 8 bytes, big-endian), in decimal.
    pub event: String,
}

/// What `blockKeys` returns.
#[derive(Serialize, Debug, PartialEq, Eq)]
pub struct Keys {
    /// One entry per full block, in order.
    pub hashes: Vec<Hash>,
}

/// Why an input was refused; its text is the JS Error's message.
#[derive(Debug, PartialEq, Eq)]
pub struct BadInput(pub String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(message: impl std::fmt::Display) -> BadInput {
    BadInput(message.to_string())
}

/// The keys of `tokens` under `options`: the native half of `blockKeys`, tested natively.
pub fn keys(tokens: &[u32], options: &Options) -> Result<Keys, BadInput> {
    let block_size = options
        .block_size
        .filter(|size| *size > 0)
        .ok_or_else(|| bad("blockSize must be a positive integer"))?;
    let algo: HashAlgo = options
        .hash_algo
        .as_deref()
        .unwrap_or("sha256_cbor")
        .parse()
        .map_err(bad)?;
    let compat: VllmCompat = options
        .vllm_compat
        .as_deref()
        .unwrap_or("0.31")
        .parse()
        .map_err(bad)?;
    let cache_salt = options
        .cache_salt
        .as_deref()
        .map(CacheSalt::parse)
        .transpose()
        .map_err(|e| bad(format!("invalid cacheSalt: {e}")))?;
    let lora = match (&options.lora_name, &options.lora_path) {
        (Some(name), Some(path)) => Some(LoraAdapter {
            name: name.clone(),
            path: path.clone(),
        }),
        (None, None) => None,
        _ => return Err(bad("loraName and loraPath go together")),
    };
    let config = KeyConfig::new(
        algo,
        block_size as usize,
        options.hash_seed.as_deref(),
        compat,
    )
    .map_err(bad)?;
    let hashes = config
        .digests(&KeyExtras { lora, cache_salt }, tokens)
        .iter()
        .map(|digest| Hash {
            full: digest.to_hex(),
            event: digest.block_key().0.to_string(),
        })
        .collect();
    Ok(Keys { hashes })
}

/// Token ids from a `Uint32Array` or an array of integers in `0..=2^32-1`; anything else
/// is refused by index rather than coerced (a `-1` would otherwise become `4294967295`).
fn token_ids(value: &JsValue) -> Result<Vec<u32>, BadInput> {
    if let Some(typed) = value.dyn_ref::<js_sys::Uint32Array>() {
        return Ok(typed.to_vec());
    }
    let Some(array) = value.dyn_ref::<js_sys::Array>() else {
        return Err(bad(
            "tokenIds must be an array of token ids or a Uint32Array",
        ));
    };
    array
        .iter()
        .enumerate()
        .map(|(i, item)| match item.as_f64() {
            Some(n) if n.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&n) => Ok(n as u32),
            Some(n) if n.fract() == 0.0 && n < 0.0 => {
                Err(bad(format!("token id {n} at index {i} is negative")))
            }
            Some(n) if n.fract() == 0.0 => Err(bad(format!(
                "token id {n} at index {i} exceeds {}",
                u32::MAX
            ))),
            _ => Err(bad(format!("token id at index {i} is not an integer"))),
        })
        .collect()
}

/// The option names `blockKeys` knows; any other is refused, so a misspelt `cacheSalt`
/// cannot silently key a request as unsalted.
const OPTION_NAMES: [&str; 7] = [
    "blockSize",
    "hashAlgo",
    "hashSeed",
    "cacheSalt",
    "loraName",
    "loraPath",
    "vllmCompat",
];

fn unknown_option(options: &JsValue) -> Option<String> {
    let object = options.dyn_ref::<js_sys::Object>()?;
    js_sys::Object::keys(object)
        .iter()
        .filter_map(|key| key.as_string())
        .find(|key| !OPTION_NAMES.contains(&key.as_str()))
}

/// `blockKeys(tokenIds, {blockSize, hashAlgo, cacheSalt, hashSeed, loraName, loraPath,
/// vllmCompat})`: vLLM's block keys; throws an Error with a one-line message on bad input.
#[wasm_bindgen(js_name = blockKeys, unchecked_return_type = "{ hashes: { full: string; event: string }[] }")]
pub fn block_keys(
    #[wasm_bindgen(unchecked_param_type = "number[] | Uint32Array")] token_ids_value: JsValue,
    #[wasm_bindgen(
        unchecked_param_type = "{ blockSize: number; hashAlgo?: string; cacheSalt?: string; hashSeed?: string; loraName?: string; loraPath?: string; vllmCompat?: string }"
    )]
    options: JsValue,
) -> Result<JsValue, JsError> {
    let tokens = token_ids(&token_ids_value).map_err(|e| JsError::new(&e.0))?;
    if let Some(name) = unknown_option(&options) {
        return Err(JsError::new(&format!(
            "unknown option {name:?}; expected one of {}",
            OPTION_NAMES.join(", ")
        )));
    }
    let options: Options = serde_wasm_bindgen::from_value(options)
        .map_err(|e| JsError::new(&format!("invalid options: {e}")))?;
    let keys = keys(&tokens, &options).map_err(|e| JsError::new(&e.0))?;
    serde_wasm_bindgen::to_value(&keys).map_err(|e| JsError::new(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(block_size: u32) -> Options {
        Options {
            block_size: Some(block_size),
            ..Options::default()
        }
    }

    #[test]
    fn keys_are_cores() {
        let tokens: Vec<u32> = (0..40).collect();
        let got = keys(&tokens, &options(16)).unwrap();
        let config = KeyConfig::new(HashAlgo::Sha256Cbor, 16, None, VllmCompat::V0_31).unwrap();
        let want = config.digests(&KeyExtras::default(), &tokens);
        assert_eq!(got.hashes.len(), 2);
        for (got, want) in got.hashes.iter().zip(&want) {
            assert_eq!(got.full, want.to_hex());
            assert_eq!(got.event, want.block_key().0.to_string());
        }
    }

    #[test]
    fn bad_options_carry_cores_message() {
        let cases: Vec<(Options, &str)> = vec![
            (Options::default(), "blockSize"),
            (options(0), "blockSize"),
            (
                Options {
                    cache_salt: Some("a/b".into()),
                    ..options(4)
                },
                "'/'",
            ),
            (
                Options {
                    hash_algo: Some("xxhash_cbor".into()),
                    ..options(4)
                },
                "needs a hash seed",
            ),
            (
                Options {
                    hash_algo: Some("md5".into()),
                    ..options(4)
                },
                "md5",
            ),
            (
                Options {
                    lora_name: Some("x".into()),
                    ..options(4)
                },
                "loraPath",
            ),
        ];
        for (options, why) in cases {
            let err = keys(&[1, 2, 3, 4], &options).unwrap_err();
            assert!(err.0.contains(why), "{err}");
            assert_eq!(err.0.lines().count(), 1, "{err}");
        }
    }
}
