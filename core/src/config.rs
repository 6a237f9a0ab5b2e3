//! The routing settings of the filter's configuration: what decides keys, modes and
//! fallbacks. The gateway's own settings (clusters, headers, deadlines) are the filter's.

use std::collections::HashMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::keys::{HashAlgo, KeyConfig, KeyConfigError, VllmCompat};

/// How the filter finds a replica for a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Exact tokens from `/tokenize`, vLLM's block keys, the KV-event index.
    #[default]
    Precise,
    /// Keys from the request text, matched against where earlier requests were sent (no
    /// tokenizer call; wrong wherever the chat template is not append-only).
    Approximate,
    /// No prefix information: the least loaded replica.
    Load,
    /// Strip routing headers and pass through.
    Off,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Self; 4] = [Self::Precise, Self::Approximate, Self::Load, Self::Off];

    /// The one spelling: configuration, route metadata and the `x-kvaffine-mode` header.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Precise => "precise",
            Self::Approximate => "approximate",
            Self::Load => "load",
            Self::Off => "off",
        }
    }

    /// The mode named `name`.
    pub fn parse(name: &[u8]) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str().as_bytes() == name)
    }
}

impl Serialize for Mode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Self::parse(name.as_bytes()).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown mode `{name}`, expected one of precise, approximate, load, off"
            ))
        })
    }
}

/// How Responses bodies are tokenized (`/tokenize` does not take them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponsesTokenize {
    /// Convert to the chat form as vLLM's `construct_input_messages` does.
    #[default]
    Convert,
    /// `POST /v1/responses/render` (vLLM with `--enable-scale-out`).
    Render,
}

/// How chat bodies are tokenized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatTokenize {
    /// `POST /tokenize` with the messages: vLLM renders them with the model's chat
    /// template, as it does for chat completions of most models.
    #[default]
    Tokenize,
    /// `POST /v1/chat/completions/render` (vLLM with `--enable-scale-out`): the renderer chat
    /// completions use. Needed for GPT-OSS, whose chats vLLM 0.32 renders with harmony while
    /// its `/tokenize` applies the chat template.
    Render,
}

fn default_paths() -> Vec<String> {
    ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
        .map(str::to_owned)
        .to_vec()
}
fn default_algo() -> String {
    "sha256_cbor".into()
}
fn default_compat() -> String {
    "0.31".into()
}
fn default_fallbacks() -> usize {
    1
}
fn default_true() -> bool {
    true
}
fn default_chunk() -> usize {
    256
}

/// The routing fields of the filter's configuration JSON.
/// (`Serialize` prints the defaults into the generated configuration reference.)
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// vLLM's `--block-size`.
    pub block_size: usize,
    /// vLLM's `--prefix-caching-hash-algo`.
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    /// The replicas' `PYTHONHASHSEED`, if set.
    #[serde(default)]
    pub hash_seed: Option<String>,
    /// `0.31` (tagged extra keys) or `0.30`.
    #[serde(default = "default_compat")]
    pub vllm_compat: String,
    /// Default mode; routes may override it in metadata.
    #[serde(default)]
    pub mode: Mode,
    /// Paths routed (POST only); anything else passes through.
    #[serde(default = "default_paths")]
    pub paths: Vec<String>,
    /// Ranked fallbacks sent after the pick.
    #[serde(default = "default_fallbacks")]
    pub fallbacks: usize,
    /// Book each pick so siblings that arrive before its events follow it.
    #[serde(default = "default_true")]
    pub book: bool,
    /// How Responses bodies are tokenized.
    #[serde(default)]
    pub responses_tokenize: ResponsesTokenize,
    /// How chat bodies are tokenized.
    #[serde(default)]
    pub chat_tokenize: ChatTokenize,
    /// LoRA adapters: model name -> adapter path as the replicas load it.
    #[serde(default)]
    pub loras: HashMap<String, String>,
    /// Bytes of request text per approximate key.
    #[serde(default = "default_chunk")]
    pub approximate_chunk_bytes: usize,
}

/// Why a configuration is refused (the gateway then rejects it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not JSON of the expected shape.
    #[error("invalid filter configuration: {0}")]
    Json(#[from] serde_json::Error),
    /// Key settings vLLM keys cannot match.
    #[error(transparent)]
    Keys(#[from] KeyConfigError),
    /// A value out of range.
    #[error("invalid filter configuration: {0}")]
    Invalid(&'static str),
}

/// Validated routing settings with their key configuration built once.
#[derive(Clone, Debug)]
pub struct Router {
    /// What was configured.
    pub config: RoutingConfig,
    /// How replicas key blocks.
    pub keys: KeyConfig,
}

impl Router {
    /// Validates routing settings.
    pub fn new(config: RoutingConfig) -> Result<Self, ConfigError> {
        let algo: HashAlgo = config.hash_algo.parse()?;
        let compat: VllmCompat = config.vllm_compat.parse()?;
        let keys = KeyConfig::new(algo, config.block_size, config.hash_seed.as_deref(), compat)?;
        if config.approximate_chunk_bytes == 0 {
            return Err(ConfigError::Invalid(
                "approximate_chunk_bytes must be at least 1",
            ));
        }
        Ok(Self { config, keys })
    }

    /// Parses and validates routing settings alone (tests and tools; the filter reads them
    /// out of its whole configuration).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::new(serde_json::from_slice(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_validated() {
        assert!(Router::from_json(b"{}").is_err());
        let bad_algo = br#"{"block_size":4,"hash_algo":"sha256"}"#;
        assert!(matches!(
            Router::from_json(bad_algo),
            Err(ConfigError::Keys(_))
        ));
        assert!(Router::from_json(br#"{"block_size":4,"nope":1}"#).is_err());
        assert!(Router::from_json(br#"{"block_size":4,"approximate_chunk_bytes":0}"#).is_err());
        let router = Router::from_json(br#"{"block_size":4}"#).unwrap();
        assert_eq!(router.config.mode, Mode::Precise);
    }

    #[test]
    fn modes_have_one_spelling() {
        for mode in Mode::ALL {
            let json = serde_json::to_string(&mode).unwrap();
            assert_eq!(json, format!("\"{}\"", mode.as_str()));
            assert_eq!(serde_json::from_str::<Mode>(&json).unwrap(), mode);
        }
        assert!(serde_json::from_str::<Mode>(r#""fast""#).is_err());
    }
}
