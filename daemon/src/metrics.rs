//! The daemon's Prometheus metrics: what an operator needs to see a mis-wired fleet
//! ("the prefix score is always 0") before users do.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of per-endpoint series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    /// The replica's `HOST:PORT`.
    pub endpoint: String,
}

/// Labels of per-endpoint, per-event-type series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    /// The replica's `HOST:PORT`.
    pub endpoint: String,
    /// `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
    pub event: String,
}

/// Labels of the alignment-mode series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// The replica's `HOST:PORT`.
    pub endpoint: String,
    /// `unknown`, `aligned` or `rekeyed`.
    pub mode: String,
}

/// Every series the daemon exports.
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Events applied.
    pub events_applied: Family<EventLabel, Counter>,
    /// Payloads or frames that did not decode.
    pub decode_errors: Family<EndpointLabel, Counter>,
    /// Times events were found missing (gaps, lost batches).
    pub gaps: Family<EndpointLabel, Counter>,
    /// Replay requests sent.
    pub replays: Family<EndpointLabel, Counter>,
    /// Replica restarts detected (seq went backwards).
    pub restarts: Family<EndpointLabel, Counter>,
    /// Blocks a re-keyed endpoint published that could not be translated.
    pub orphans: Family<EndpointLabel, Counter>,
    /// Index entries refused at the entry limit.
    pub dropped_entries: Family<EndpointLabel, Counter>,
    /// Seconds from a batch's `ts` to its application.
    pub event_lag: Histogram,
    /// (block, endpoint) entries in the index.
    pub index_entries: Gauge,
    /// Bytes of the index tables.
    pub index_bytes: Gauge,
    /// Lookup handling time, seconds.
    pub lookup_seconds: Histogram,
    /// 1 for the endpoint's current alignment mode.
    pub alignment: Family<ModeLabel, Gauge>,
    /// 1 while the endpoint's settings do not match the daemon's.
    pub misconfigured: Family<EndpointLabel, Gauge>,
    /// 1 while the endpoint's index is known to be incomplete.
    pub incomplete: Family<EndpointLabel, Gauge>,
}

impl Metrics {
    /// Registers every series under the `kvaffined` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvaffined");
        let metrics = Self {
            events_applied: Family::default(),
            decode_errors: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            restarts: Family::default(),
            orphans: Family::default(),
            dropped_entries: Family::default(),
            event_lag: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            index_entries: Gauge::default(),
            index_bytes: Gauge::default(),
            lookup_seconds: Histogram::new(exponential_buckets(0.000_002, 2.0, 16)),
            alignment: Family::default(),
            misconfigured: Family::default(),
            incomplete: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "events_applied",
            "KV events applied to the index",
            metrics.events_applied.clone(),
        );
        registry.register(
            "decode_errors",
            "Event payloads or frames that did not decode",
            metrics.decode_errors.clone(),
        );
        registry.register(
            "event_gaps",
            "Times events were found lost (sequence gaps)",
            metrics.gaps.clone(),
        );
        registry.register("replays", "Replay requests sent", metrics.replays.clone());
        registry.register(
            "replica_restarts",
            "Replica restarts detected from sequence numbers",
            metrics.restarts.clone(),
        );
        registry.register(
            "rekey_orphans",
            "Blocks of re-keyed endpoints that could not be translated",
            metrics.orphans.clone(),
        );
        registry.register(
            "index_dropped_entries",
            "Index entries refused at --max-entries",
            metrics.dropped_entries.clone(),
        );
        registry.register(
            "event_lag_seconds",
            "Time from a batch's timestamp to its application",
            metrics.event_lag.clone(),
        );
        registry.register(
            "index_entries",
            "(block, endpoint) entries in the index",
            metrics.index_entries.clone(),
        );
        registry.register(
            "index_bytes",
            "Bytes held by the index tables",
            metrics.index_bytes.clone(),
        );
        registry.register(
            "lookup_seconds",
            "Lookup handling time",
            metrics.lookup_seconds.clone(),
        );
        registry.register(
            "endpoint_alignment",
            "1 for the endpoint's key alignment mode",
            metrics.alignment.clone(),
        );
        registry.register(
            "endpoint_misconfigured",
            "1 while the endpoint's vLLM settings do not match the daemon's",
            metrics.misconfigured.clone(),
        );
        registry.register(
            "endpoint_incomplete",
            "1 while the endpoint's index is known to be incomplete",
            metrics.incomplete.clone(),
        );
        Self {
            registry,
            ..metrics
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
