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
    /// Variable of the filter VM's environment (Envoy: `vm_config.environment_variables`)
    /// holding that token, so it can come from a Kubernetes Secret; used when
    /// `index_token` is not set. Named here, it must be there; by default
    /// `KVAFFINE_INDEX_TOKEN` is read if present.
    #[serde(default)]
    pub index_token_env: Option<String>,
    /// Deadline of each callout, milliseconds.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// On Envoy, how long a streamed request (`"stream": true`) may wait for its
    /// replica's response headers before Envoy gives up on that replica and retries the
    /// next ranked one (the filter sets `x-envoy-upstream-rq-per-try-timeout-ms`; the
    /// route's retry policy must retry on `5xx` or `gateway-error`). vLLM sends a stream's
    /// headers once it has rendered and tokenized the prompt, before scheduling it, so
    /// only a frozen or dying replica (or preprocessing slower than this) keeps them back;
    /// a non-streamed answer's headers come with its last token, so those requests are
    /// left to the route's own timeouts. 0 (the default) sets nothing.
    #[serde(default)]
    pub stream_headers_timeout_ms: u64,
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
    /// Compare each precisely routed request's prediction (matched blocks x block size)
    /// with the cached prompt tokens its replica reports in the answer's `usage` (read as
    /// the answer passes, never changed or held): Envoy stats per replica
    /// (`kvaffine.endpoint.<host_port>.*`), and the outcomes sent to the index in batches
    /// each second (`POST /v1/outcomes`) for its metrics and console. Off by default.
    #[serde(default)]
    pub report_outcomes: bool,
    /// Before tokenizing a request with a `cache_salt`, ask the index whether any replica
    /// holds a first block of that salt (`POST /v2/salt`): when none does, no cached
    /// prefix can match, and the request is pinned by load with no tokenizer call (its
    /// text keys, seeded by its template inputs, let the salt's next requests follow it
    /// only as far as they render alike). Off by default: on two overloaded emulated
    /// replicas, concurrency's hit rate is bimodal with and without it, and 7 runs each
    /// could not tell whether it makes the bad mode more likely (`docs/daemon.md`).
    #[serde(default)]
    pub salt_probes: bool,
    /// Hand each request's tokenizer call to the index (`POST /v2/route`): kvaffined
    /// calls the least busy replica's tokenizer, keys its answer with this configuration's
    /// key settings and looks up, all in one callout, so the gateway makes one callout per
    /// request instead of two (with `salt_probes`, the probe rides on it too). The
    /// tokenizer cluster is then used only by an index before `/v2/route` (answering 404),
    /// and the replicas kvaffined follows must serve the tokenizer. A route can choose
    /// with route metadata `filter_metadata.kvaffine.tokenize_at`: `index` or `gateway`.
    /// Off by default.
    #[serde(default)]
    pub tokenize_at_index: bool,
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

/// The VM variable read for the lookup token when the configuration names none.
pub const DEFAULT_TOKEN_VARIABLE: &str = "KVAFFINE_INDEX_TOKEN";

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct FilterConfig {
    /// Where to call and what to set.
    pub gateway: GatewayConfig,
    /// How to key and route.
    pub router: Router,
    /// The bearer token lookups carry, from `index_token` or the VM's environment.
    pub index_token: Option<String>,
}

impl FilterConfig {
    /// Parses and validates the plugin configuration, reading the VM's environment.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::from_json_with(bytes, |name| std::env::var(name).ok())
    }

    /// As [`Self::from_json`], with `variable` as the VM's environment.
    pub fn from_json_with(
        bytes: &[u8],
        variable: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
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
        let index_token = match (&gateway.index_token, &gateway.index_token_env) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid(
                    "index_token and index_token_env are exclusive",
                ));
            }
            (Some(token), None) => Some(token.clone()),
            (None, Some(name)) => Some(variable(name).filter(|t| !t.is_empty()).ok_or(
                ConfigError::Invalid(
                    "index_token_env names a variable the VM's environment does not have \
                     (Envoy: vm_config.environment_variables.host_env_keys)",
                ),
            )?),
            (None, None) => variable(DEFAULT_TOKEN_VARIABLE).filter(|t| !t.is_empty()),
        };
        Ok(Self {
            gateway,
            router: Router::new(routing)?,
            index_token,
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
        let unknown = FilterConfig::from_json_with(
            br#"{"tokenizer_cluster":"t","index_cluster":"i","block_size":4,"nope":1}"#,
            |_| None,
        )
        .unwrap_err();
        assert!(unknown.to_string().contains("nope"), "{unknown}");
    }

    #[test]
    fn the_token_comes_from_the_configuration_or_the_environment() {
        let env = |name: &str| match name {
            DEFAULT_TOKEN_VARIABLE => Some("from-default".to_owned()),
            "SECRET" => Some("from-secret".to_owned()),
            _ => None,
        };
        let token = |extra: &str, env: &dyn Fn(&str) -> Option<String>| {
            let json =
                format!(r#"{{"tokenizer_cluster":"t","index_cluster":"i","block_size":4{extra}}}"#);
            FilterConfig::from_json_with(json.as_bytes(), env).map(|c| c.index_token)
        };
        assert_eq!(
            token(r#","index_token":"x""#, &env).unwrap().as_deref(),
            Some("x")
        );
        assert_eq!(
            token(r#","index_token_env":"SECRET""#, &env)
                .unwrap()
                .as_deref(),
            Some("from-secret")
        );
        assert_eq!(token("", &env).unwrap().as_deref(), Some("from-default"));
        assert_eq!(
            token("", &|_| None).unwrap(),
            None,
            "no token anywhere: none"
        );
        assert!(token(r#","index_token_env":"MISSING""#, &env).is_err());
        assert!(token(r#","index_token":"x","index_token_env":"SECRET""#, &env).is_err());
    }
}
