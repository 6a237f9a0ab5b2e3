//! The filter's whole configuration: the gateway's settings (where to call, which headers
//! to set, how long to wait) here, the routing settings in `kvaffine_core::config`. One
//! flat JSON object carries both; every field belongs to exactly one of them, and a field
//! that belongs to neither is refused.

use kvaffine_core::config::{ConfigError, Router, RoutingConfig};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Which gateway the filter runs in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Host {
    /// Callouts by cluster name; pin with the endpoint header; clear the route cache.
    #[default]
    Envoy,
    /// Callouts by `host:port`; pin with the `kong.service.target` property.
    Kong,
}

fn default_timeout() -> u64 {
    300
}
fn default_max_body() -> usize {
    16 * 1024 * 1024
}
fn default_endpoint_header() -> String {
    "x-gateway-destination-endpoint".into()
}
fn default_model_header() -> String {
    "x-kvaffine-model".into()
}

/// The gateway fields of the filter's configuration JSON.
/// (`Serialize` prints the defaults into the generated configuration reference.)
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Upstream of `/tokenize` calls: an Envoy cluster, or `host:port` on Kong.
    pub tokenizer_cluster: String,
    /// `:authority` of tokenize calls (default: the cluster name).
    #[serde(default)]
    pub tokenizer_authority: Option<String>,
    /// Upstream of the index daemon.
    pub index_cluster: String,
    /// `:authority` of lookups (default: the cluster name).
    #[serde(default)]
    pub index_authority: Option<String>,
    /// Bearer token sent with every lookup, for a kvaffined started with
    /// `--auth-token-file` (default: none).
    #[serde(default)]
    pub index_token: Option<String>,
    /// Deadline of each callout, milliseconds.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// Larger bodies are forwarded unrouted.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// The gateway: `envoy` (callouts to clusters, pin by header) or `kong` (callouts to
    /// `host:port`, pin by the `kong.service.target` property).
    #[serde(default)]
    pub host: Host,
    /// Request header that carries the pick (Envoy's override_host source).
    #[serde(default = "default_endpoint_header")]
    pub endpoint_header: String,
    /// Request header that carries the body's `model`, for model-to-pool routes.
    #[serde(default = "default_model_header")]
    pub model_header: String,
}

impl GatewayConfig {
    /// The `:authority` of tokenizer calls.
    pub fn tokenizer_authority(&self) -> &str {
        self.tokenizer_authority
            .as_deref()
            .unwrap_or(&self.tokenizer_cluster)
    }

    /// The `:authority` of lookups.
    pub fn index_authority(&self) -> &str {
        self.index_authority
            .as_deref()
            .unwrap_or(&self.index_cluster)
    }
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct FilterConfig {
    /// Where to call and what to set.
    pub gateway: GatewayConfig,
    /// How to key and route.
    pub router: Router,
}

impl FilterConfig {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let whole: Map<String, Value> = serde_json::from_slice(bytes)?;
        let gateway_fields = serde_aux::serde_introspection::serde_introspect::<GatewayConfig>();
        let (gateway, routing): (Map<String, Value>, Map<String, Value>) = whole
            .into_iter()
            .partition(|(name, _)| gateway_fields.contains(&name.as_str()));
        let gateway: GatewayConfig = serde_json::from_value(Value::Object(gateway))?;
        let routing: RoutingConfig = serde_json::from_value(Value::Object(routing))?;
        if gateway.timeout_ms == 0 {
            return Err(ConfigError::Invalid("timeout_ms must be at least 1"));
        }
        if gateway.endpoint_header.is_empty() || gateway.model_header.is_empty() {
            return Err(ConfigError::Invalid("header names must not be empty"));
        }
        Ok(Self {
            gateway,
            router: Router::new(routing)?,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn each_field_goes_to_its_part_and_strangers_are_refused() {
        let config = FilterConfig::from_json(
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"fallbacks":2,"host":"kong","timeout_ms":50}"#,
        )
        .unwrap();
        assert_eq!(
            (config.gateway.host, config.gateway.timeout_ms),
            (Host::Kong, 50)
        );
        assert_eq!(config.router.config.fallbacks, 2);
        assert_eq!(config.gateway.index_authority(), "i");
        for bad in [
            &br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"nope":1}"#[..],
            br#"{"tokenizer_cluster":"t","index_cluster":"i"}"#,
            br#"{"index_cluster":"i","block_size":4}"#,
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"timeout_ms":0}"#,
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"endpoint_header":""}"#,
            b"[]",
        ] {
            assert!(
                FilterConfig::from_json(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let unknown = FilterConfig::from_json(
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"nope":1}"#,
        )
        .unwrap_err();
        assert!(unknown.to_string().contains("nope"), "{unknown}");
    }
}
