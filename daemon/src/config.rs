//! What `kvaffined serve` is told, validated before any socket is opened: every bad entry
//! is reported, then the command fails once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use kvaffine_core::{HashAlgo, KeyConfig, PickPolicy, VllmCompat};

use crate::speed::SpeedFlags;
use serde::Deserialize;

/// A mebibyte, for byte flags.
const MIB_BYTES: i64 = 1 << 20;

/// Flags of `kvaffined serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address of the lookup API. Loopback by default: the gateway runs beside it.
    #[arg(long, default_value = "127.0.0.1:9100")]
    pub listen: SocketAddr,
    /// vLLM's `--block-size`.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,
    /// vLLM's `--prefix-caching-hash-algo` (sha256_cbor or xxhash_cbor).
    #[arg(long, default_value = "sha256_cbor")]
    pub hash_algo: HashAlgo,
    /// The replicas' `PYTHONHASHSEED`, if set.
    #[arg(long)]
    pub hash_seed: Option<String>,
    /// Extra-key encoding of the replicas' vLLM: 0.31 (>= 0.31) or 0.30.
    #[arg(long, default_value = "0.31")]
    pub vllm_compat: VllmCompat,
    /// A JSON file of endpoints, re-read when it changes (see docs/daemon.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Bearer tokens the lookup API requires, one per line, re-read when the file changes
    /// (several at once, for rotation); `/healthz`, `/readyz` and `/metrics` stay open.
    /// Unset: no authentication.
    #[arg(long)]
    pub auth_token_file: Option<PathBuf>,
    /// `HOST:PORT=EVENTS_URL[,REPLAY_URL]`: a replica's HTTP address (what the gateway pins
    /// to) and its ZMQ PUB and replay (ROUTER) endpoints. Repeatable.
    #[arg(long = "endpoint", value_parser = parse_endpoint)]
    pub endpoints: Vec<EndpointSpec>,
    /// `HOST:PORT` of a vLLM replica (>= 0.31) whose `/kv_event_sources` names its event
    /// endpoints, one per data-parallel rank. Repeatable.
    #[arg(long = "discover")]
    pub discover: Vec<String>,
    /// `NAME:PORT` whose DNS records are the replicas (a Kubernetes headless Service):
    /// re-resolved every second, each address asked for its `/kv_event_sources` and pinned
    /// by its IP. Repeatable.
    #[arg(long = "discover-dns")]
    pub discover_dns: Vec<String>,
    /// `HOST:PORT` of another kvaffined in front of the same replicas (beside another
    /// gateway): every pick booked here is booked there too, with this daemon's first API
    /// token if `--auth-token-file` is given. Repeatable; the config file's `peers` add
    /// to these.
    #[arg(long = "peer", value_parser = parse_peer)]
    pub peers: Vec<String>,
    /// `NAME:PORT` whose DNS records are peers, as with `--peer` (a headless Service of the
    /// gateway pods, on this daemon's API port): re-resolved every second. The answer may
    /// hold this daemon too: it finds itself by the name it sends its peers and leaves
    /// itself out. Repeatable.
    #[arg(long = "peer-dns", value_parser = parse_peer)]
    pub peer_dns: Vec<String>,
    /// The replicas' `kv-events-config` topic.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// `NAME=PATH` of a LoRA adapter as replicas load it (vLLM >= 0.31 keys the path).
    #[arg(long = "lora", value_parser = parse_lora)]
    pub loras: Vec<(String, String)>,
    /// Most keys one lookup may carry (more: 413).
    #[arg(long, default_value_t = 16_384)]
    pub max_keys: usize,
    /// Lookups handled at once; one more is refused at once with 503 (counted in
    /// `kvaffined_shed_lookups_total`) rather than queued, and the filter routes it
    /// unpinned within its deadline.
    #[arg(long, default_value_t = 1024)]
    pub max_inflight_lookups: usize,
    /// Most (block, endpoint) entries the index holds, shared equally by the followed
    /// event streams; past its share a stream's new blocks are dropped and counted, so one
    /// flooding replica cannot crowd out the others. Size it to the fleet's total KV
    /// blocks.
    #[arg(long, default_value_t = 50_000_000)]
    pub max_entries: usize,
    /// Largest KV-event message (or replay answer) read from a replica; a larger one is
    /// refused by libzmq, which drops that connection, so a broken or hostile publisher
    /// cannot make kvaffined buffer it. vLLM's largest is one batch of a very long prompt,
    /// at most about 5 bytes per prompt token (a msgpack integer each, plus the block hashes).
    #[arg(long, default_value_t = 64 * MIB_BYTES, value_parser = clap::value_parser!(i64).range(1..))]
    pub max_event_message_bytes: i64,
    /// How long a booked pick counts as holding its prefix before events confirm it.
    #[arg(long, default_value_t = 2000)]
    pub booking_ttl_ms: u64,
    /// Most block keys booked at once (about 110 bytes each); past it picks are not booked
    /// (counted) until bookings expire or are confirmed.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_booked_keys: usize,
    /// How often each replica's `/metrics` and `/health` are read (each waits at most this
    /// long, at least 200 ms); a replica that does not answer both is ranked after the
    /// others.
    #[arg(long, default_value_t = 500)]
    pub scrape_interval_ms: u64,
    /// A replica with this many more waiting requests than the least-waiting usable one
    /// is saturated.
    #[arg(long, default_value_t = PickPolicy::default().max_waiting)]
    pub max_waiting: u32,
    /// A replica with this many seconds of pending prefill, at its measured speed, is
    /// saturated (the default is 65,536 tokens at the default 5,000 tokens/s).
    #[arg(long, default_value_t = PickPolicy::default().max_pending_prefill_seconds)]
    pub max_pending_prefill_seconds: f64,
    /// A replica with this many pending prefill tokens is saturated, whatever its speed
    /// (replaces --max-pending-prefill-seconds).
    #[arg(long)]
    pub max_pending_prefill_tokens: Option<u64>,
    /// Prefill cost of a cached token relative to a computed one on every replica, and no
    /// cost of the context a computed token attends over: the linear model, instead of
    /// what each replica's requests measure (a tenth until they tell it apart).
    #[arg(long)]
    pub cached_token_cost: Option<f64>,
    /// How fast every replica prefills, in tokens per second, instead of what each
    /// measures (its `vllm:request_prefill_time_seconds` against its
    /// `vllm:request_prefill_kv_computed_tokens`; 5,000 until anything is measured).
    #[arg(long)]
    pub prefill_tokens_per_second: Option<f64>,
    /// A request's fixed prefill cost in computed-token equivalents (scheduling, sampling
    /// setup) on every replica, instead of what each measures (200 until anything is
    /// measured).
    #[arg(long)]
    pub request_overhead_tokens: Option<u64>,
    /// Matches shorter than this many blocks count as none.
    #[arg(long, default_value_t = PickPolicy::default().min_matched_blocks)]
    pub min_matched_blocks: usize,
    /// Give up on a replay that has not finished after this long.
    #[arg(long, default_value_t = 5000)]
    pub replay_timeout_ms: u64,
}

/// One replica as kvaffine follows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize)]
pub struct EndpointSpec {
    /// `HOST:PORT` of the replica's HTTP server: the value the gateway pins to.
    pub endpoint: String,
    /// Its ZMQ PUB endpoint.
    pub events: String,
    /// Its ZMQ replay (ROUTER) endpoint, if it has one.
    #[serde(default)]
    pub replay: Option<String>,
    /// The data-parallel rank publishing there (each rank of a replica has its own stream;
    /// lookups report the replica's best rank).
    #[serde(default)]
    pub rank: u32,
}

impl EndpointSpec {
    /// How this stream is named in logs and metrics: `HOST:PORT`, with `#dpN` for ranks > 0.
    pub fn stream_name(&self) -> String {
        if self.rank == 0 {
            self.endpoint.clone()
        } else {
            format!("{}#dp{}", self.endpoint, self.rank)
        }
    }
}

fn parse_endpoint(text: &str) -> Result<EndpointSpec, String> {
    let (endpoint, urls) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected HOST:PORT=EVENTS_URL[,REPLAY_URL]"))?;
    let (events, replay) = match urls.split_once(',') {
        Some((events, replay)) => (events, Some(replay.to_owned())),
        None => (urls, None),
    };
    let spec = EndpointSpec {
        endpoint: endpoint.to_owned(),
        events: events.to_owned(),
        replay,
        rank: 0,
    };
    spec.validate().map_err(|e| format!("{text:?}: {e}"))?;
    Ok(spec)
}

fn parse_lora(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(n, p)| (n.to_owned(), p.to_owned()))
        .ok_or_else(|| format!("{text:?}: expected NAME=PATH"))
}

impl EndpointSpec {
    fn validate(&self) -> Result<(), String> {
        let (host, port) = self
            .endpoint
            .rsplit_once(':')
            .ok_or("endpoint must be HOST:PORT")?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err("endpoint must be HOST:PORT".into());
        }
        for url in std::iter::once(&self.events).chain(self.replay.as_ref()) {
            if !(url.starts_with("tcp://")
                || url.starts_with("ipc://")
                || url.starts_with("inproc://"))
            {
                return Err(format!("{url:?} is not a ZMQ endpoint (tcp://, ipc://)"));
            }
        }
        Ok(())
    }
}

/// The config file: a superset of what flags can say, re-read when it changes.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Replicas followed in addition to the `--endpoint` flags.
    #[serde(default)]
    pub endpoints: Vec<EndpointSpec>,
    /// Replicas discovered through their `/kv_event_sources`, as with `--discover`.
    #[serde(default)]
    pub discover: Vec<String>,
    /// Daemons bookings are shared with, as with `--peer`.
    #[serde(default)]
    pub peers: Vec<String>,
}

impl ConfigFile {
    /// Parses and validates the file's text.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: Self = serde_json::from_str(text)?;
        let errors: Vec<String> = file
            .endpoints
            .iter()
            .filter_map(|e| {
                e.validate()
                    .err()
                    .map(|err| format!("{}: {err}", e.endpoint))
            })
            .collect();
        if !errors.is_empty() {
            bail!("invalid endpoints: {}", errors.join("; "));
        }
        for peer in &file.peers {
            parse_peer(peer).map_err(|err| anyhow::anyhow!("invalid peer: {err}"))?;
        }
        Ok(file)
    }
}

/// A peer daemon's `HOST:PORT`.
fn parse_peer(text: &str) -> Result<String, String> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(text.to_owned())
        }
        _ => Err(format!("{text:?}: expected HOST:PORT of another kvaffined")),
    }
}

/// Settings derived once from the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How replicas key blocks.
    pub keys: KeyConfig,
    /// The replicas' `PYTHONHASHSEED` the keys were built with (the console keys with it).
    pub hash_seed: Option<String>,
    /// The ranking knobs.
    pub policy: PickPolicy,
    /// The `kv-events-config` topic.
    pub topic: String,
    /// LoRA adapter paths by name.
    pub lora_paths: HashMap<String, String>,
    /// Most keys per lookup.
    pub max_keys: usize,
    /// Most lookups in flight.
    pub max_inflight_lookups: usize,
    /// Index entry bound.
    pub max_entries: usize,
    /// Largest event message accepted.
    pub max_event_message_bytes: i64,
    /// Booking lifetime.
    pub booking_ttl: Duration,
    /// Booked key bound.
    pub max_booked_keys: usize,
    /// Scrape period.
    pub scrape_interval: Duration,
    /// Prefill figures the operator fixed, instead of the measured ones.
    pub speed_flags: SpeedFlags,
    /// Replay deadline.
    pub replay_timeout: Duration,
}

impl ServeArgs {
    /// Derives the settings, or says everything that is wrong at once.
    pub fn settings(&self) -> anyhow::Result<Settings> {
        let keys = KeyConfig::new(
            self.hash_algo,
            self.block_size as usize,
            self.hash_seed.as_deref(),
            self.vllm_compat,
        )?;
        if self.max_keys == 0 {
            bail!("--max-keys must be at least 1");
        }
        if self.max_inflight_lookups == 0 {
            bail!("--max-inflight-lookups must be at least 1");
        }
        if self
            .prefill_tokens_per_second
            .is_some_and(|rate| rate.is_nan() || rate <= 0.0 || rate.is_infinite())
        {
            bail!("--prefill-tokens-per-second must be a positive number");
        }
        if self.max_pending_prefill_seconds.is_nan() || self.max_pending_prefill_seconds <= 0.0 {
            bail!("--max-pending-prefill-seconds must be positive");
        }
        if self
            .cached_token_cost
            .is_some_and(|cost| !(0.0..=1.0).contains(&cost))
        {
            bail!("--cached-token-cost must be between 0 and 1");
        }
        Ok(Settings {
            keys,
            hash_seed: self.hash_seed.clone(),
            policy: PickPolicy {
                block_size: self.block_size as usize,
                max_waiting: self.max_waiting,
                max_pending_prefill_seconds: self.max_pending_prefill_seconds,
                max_pending_prefill_tokens: self.max_pending_prefill_tokens,
                min_matched_blocks: self.min_matched_blocks,
            },
            topic: self.topic.clone(),
            lora_paths: self.loras.iter().cloned().collect(),
            max_keys: self.max_keys,
            max_inflight_lookups: self.max_inflight_lookups,
            max_entries: self.max_entries,
            max_event_message_bytes: self.max_event_message_bytes,
            booking_ttl: Duration::from_millis(self.booking_ttl_ms),
            max_booked_keys: self.max_booked_keys,
            scrape_interval: Duration::from_millis(self.scrape_interval_ms.max(10)),
            speed_flags: SpeedFlags {
                tokens_per_second: self.prefill_tokens_per_second,
                overhead_tokens: self.request_overhead_tokens.map(|t| t as f64),
                cached_token_cost: self.cached_token_cost,
            },
            replay_timeout: Duration::from_millis(self.replay_timeout_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_flags_parse_with_and_without_replay() {
        let spec = parse_endpoint("10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558").unwrap();
        assert_eq!(spec.endpoint, "10.0.0.5:8000");
        assert_eq!(spec.replay.as_deref(), Some("tcp://10.0.0.5:5558"));
        assert_eq!(parse_endpoint("h:1=tcp://h:2").unwrap().replay, None);
        for bad in [
            "h:1",
            "h=tcp://x:1",
            "h:port=tcp://x:1",
            "h:1=http://x:1",
            "h:1=tcp://x:1,udp://y",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn config_files_reject_unknown_fields_and_bad_endpoints() {
        let ok = r#"{"endpoints":[{"endpoint":"a:1","events":"tcp://a:2","replay":"tcp://a:3"}]}"#;
        assert_eq!(ConfigFile::parse(ok).unwrap().endpoints.len(), 1);
        assert!(ConfigFile::parse(r#"{"endpoint":[]}"#).is_err());
        assert!(
            ConfigFile::parse(r#"{"endpoints":[{"endpoint":"a","events":"tcp://a:2"}]}"#).is_err()
        );
    }
}
