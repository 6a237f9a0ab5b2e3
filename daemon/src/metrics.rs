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

/// Labels of the lookup series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why the first-ranked endpoint is first (`kvaffine_core::Reason`'s spelling).
    pub reason: &'static str,
}

/// Labels of the peer booking series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    /// `sent` (to one peer), `failed` (a peer did not take them), `dropped` (the queue
    /// to the peers was full), `received` (held here as made), `restored` (taken from a
    /// peer at start), `already_stored` (its replica's events came first) or
    /// `unknown_stream` (a stream this daemon does not follow).
    pub outcome: &'static str,
}

/// Labels of the outcome series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// The replica's `HOST:PORT`.
    pub endpoint: String,
    /// `exact`, `over` (more predicted than served) or `under`.
    pub result: &'static str,
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
    /// Block keys held by live bookings.
    pub booked_keys: Gauge,
    /// Lookup handling time, seconds.
    pub lookup_seconds: Histogram,
    /// Tokenizer calls made for routed requests (`/v2/route`), seconds.
    pub route_tokenize_seconds: Histogram,
    /// Those that failed (no replica, an error, a timeout, no token list).
    pub route_tokenize_failures: Counter,
    /// 1 for the endpoint's current alignment mode.
    pub alignment: Family<ModeLabel, Gauge>,
    /// 1 while the endpoint's settings do not match the daemon's.
    pub misconfigured: Family<EndpointLabel, Gauge>,
    /// 1 while the endpoint's KV-cache groups are ones kvaffine cannot follow.
    pub kv_cache_unsupported: Family<EndpointLabel, Gauge>,
    /// 1 while the endpoint's index is known to be incomplete.
    pub incomplete: Family<EndpointLabel, Gauge>,
    /// API requests refused for a missing or wrong bearer token.
    pub unauthorized: Counter,
    /// Lookups ranked with their cached prefix in demand by others (queues count twice).
    pub shared_prefix_lookups: Counter,
    /// Lookups answered, by the reason of their ranking.
    pub lookups: Family<ReasonLabel, Counter>,
    /// Lookups refused at `--max-inflight-lookups`.
    pub shed: Counter,
    /// Salt probes answered with "tokenize": a replica holds, or may hold, the salt.
    pub salt_probes_held: Counter,
    /// Picks not booked at `--max-booked-keys`.
    pub bookings_refused: Counter,
    /// Bookings shared with peers and taken from them, by outcome.
    pub peer_bookings: Family<PeerLabel, Counter>,
    /// Peers bookings go to, as the last discovery poll read them.
    pub peers: Gauge,
    /// Tokens the filter predicted cached, per replica (its reported outcomes).
    pub outcome_predicted: Family<EndpointLabel, Counter>,
    /// Tokens the replica reported cached, per replica (the same outcomes).
    pub outcome_cached: Family<EndpointLabel, Counter>,
    /// Absolute difference of the two, per outcome, summed.
    pub outcome_error: Family<EndpointLabel, Counter>,
    /// Outcomes, by whether the prediction was exact, over or under.
    pub outcomes: Family<ResultLabel, Counter>,
    /// Tokens this daemon's booked picks predicted cached, per replica.
    pub booked_predicted: Family<EndpointLabel, Counter>,
    /// The replica's own `vllm:prefix_cache_hits_total`, followed by scrapes.
    pub replica_cache_hits: Family<EndpointLabel, Counter>,
    /// The prefill speed the ranking weighs each replica's work at.
    pub prefill_tokens_per_second: Family<EndpointLabel, FloatGauge>,
    /// The fixed prefill cost per request it adds.
    pub prefill_overhead_seconds: Family<EndpointLabel, FloatGauge>,
    /// What a cached prompt token costs there against a computed one.
    pub prefill_cached_token_cost: Family<EndpointLabel, FloatGauge>,
    /// What a computed token costs more there per token of context before it.
    pub prefill_context_cost: Family<EndpointLabel, FloatGauge>,
}

/// A gauge of fractional values.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

impl Default for Metrics {
    /// Registers every series under the `kvaffined` prefix.
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvaffined");
        let events_applied = Family::<EventLabel, Counter>::default();
        let decode_errors = Family::<EndpointLabel, Counter>::default();
        let gaps = Family::<EndpointLabel, Counter>::default();
        let replays = Family::<EndpointLabel, Counter>::default();
        let restarts = Family::<EndpointLabel, Counter>::default();
        let orphans = Family::<EndpointLabel, Counter>::default();
        let dropped_entries = Family::<EndpointLabel, Counter>::default();
        let event_lag = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let index_entries = Gauge::default();
        let index_bytes = Gauge::default();
        let booked_keys = Gauge::default();
        let lookup_seconds = Histogram::new(exponential_buckets(0.000_002, 2.0, 16));
        let route_tokenize_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 16));
        let route_tokenize_failures = Counter::default();
        registry.register(
            "route_tokenize_seconds",
            "Tokenizer calls this daemon made for requests a filter handed it whole (POST /v2/route), from sending to the token list",
            route_tokenize_seconds.clone(),
        );
        registry.register(
            "route_tokenize_failures",
            "Of those, the ones that failed (no replica to call, an error status, a timeout, no token list): the filter routes them by their text instead",
            route_tokenize_failures.clone(),
        );
        let alignment = Family::<ModeLabel, Gauge>::default();
        let misconfigured = Family::<EndpointLabel, Gauge>::default();
        let kv_cache_unsupported = Family::<EndpointLabel, Gauge>::default();
        let incomplete = Family::<EndpointLabel, Gauge>::default();
        let unauthorized = Counter::default();
        let shared_prefix_lookups = Counter::default();
        let lookups = Family::<ReasonLabel, Counter>::default();
        let shed = Counter::default();
        let salt_probes_held = Counter::default();
        let bookings_refused = Counter::default();
        let peer_bookings = Family::<PeerLabel, Counter>::default();
        let peers = Gauge::default();
        let outcome_predicted = Family::<EndpointLabel, Counter>::default();
        let outcome_cached = Family::<EndpointLabel, Counter>::default();
        let outcome_error = Family::<EndpointLabel, Counter>::default();
        let outcomes = Family::<ResultLabel, Counter>::default();
        let booked_predicted = Family::<EndpointLabel, Counter>::default();
        let replica_cache_hits = Family::<EndpointLabel, Counter>::default();
        let prefill_tokens_per_second = Family::<EndpointLabel, FloatGauge>::default();
        let prefill_overhead_seconds = Family::<EndpointLabel, FloatGauge>::default();
        let prefill_cached_token_cost = Family::<EndpointLabel, FloatGauge>::default();
        let prefill_context_cost = Family::<EndpointLabel, FloatGauge>::default();
        registry.register(
            "replica_prefill_tokens_per_second",
            "Computed prompt tokens per second the ranking assumes the replica prefills (measured from its own metrics unless --prefill-tokens-per-second is given)",
            prefill_tokens_per_second.clone(),
        );
        registry.register(
            "replica_prefill_overhead_seconds",
            "Fixed prefill cost per request the ranking assumes for the replica (measured unless --request-overhead-tokens is given)",
            prefill_overhead_seconds.clone(),
        );
        registry.register(
            "replica_prefill_cached_token_cost",
            "Prefill cost of a cached prompt token against a computed one the ranking assumes for the replica (measured unless --cached-token-cost is given)",
            prefill_cached_token_cost.clone(),
        );
        registry.register(
            "replica_prefill_context_cost",
            "Extra prefill cost of a computed token per token of context before it, against its own cost, the ranking assumes for the replica (measured; 0 with --cached-token-cost)",
            prefill_context_cost.clone(),
        );
        registry.register(
            "outcome_predicted_cached_tokens",
            "Prompt tokens the filter predicted the replica would serve from its KV cache (reported outcomes)",
            outcome_predicted.clone(),
        );
        registry.register(
            "outcome_cached_tokens",
            "Prompt tokens the replica reported it served from its KV cache (the same outcomes)",
            outcome_cached.clone(),
        );
        registry.register(
            "outcome_prediction_error_tokens",
            "Absolute difference of predicted and reported cached tokens, summed over outcomes",
            outcome_error.clone(),
        );
        registry.register(
            "outcomes",
            "Reported outcomes, by whether the prediction was exact, over or under",
            outcomes.clone(),
        );
        registry.register(
            "booked_predicted_cached_tokens",
            "Prompt tokens this daemon's booked picks predicted cached (compare with replica_prefix_cache_hit_tokens where answers carry no usage)",
            booked_predicted.clone(),
        );
        registry.register(
            "replica_prefix_cache_hit_tokens",
            "The replica's own vllm:prefix_cache_hits_total, as scraped (all its traffic, not only the gateway's)",
            replica_cache_hits.clone(),
        );
        registry.register(
            "bookings_refused",
            "Picks not booked because --max-booked-keys keys were booked",
            bookings_refused.clone(),
        );
        registry.register(
            "peer_bookings",
            "Bookings shared with --peer daemons (sent, failed, dropped) and taken from them (received as made, restored at start, unknown_stream, already_stored)",
            peer_bookings.clone(),
        );
        registry.register(
            "peers",
            "Peers bookings go to (--peer, --peer-dns and the config file's peers, less this daemon itself), as last read",
            peers.clone(),
        );
        registry.register(
            "salt_probes_held",
            "Salt probes answered with tokenize: a replica holds, or may hold, a first block of the salt (probes routed at once count in lookups, reasons new-salt and salt-booked)",
            salt_probes_held.clone(),
        );
        registry.register(
            "shed_lookups",
            "Lookups refused with 503 because --max-inflight-lookups were in flight",
            shed.clone(),
        );
        registry.register(
            "lookups",
            "Lookups answered, by why the first-ranked endpoint is first",
            lookups.clone(),
        );
        registry.register(
            "events_applied",
            "KV events applied to the index",
            events_applied.clone(),
        );
        registry.register(
            "decode_errors",
            "Event payloads or frames that did not decode",
            decode_errors.clone(),
        );
        registry.register(
            "event_gaps",
            "Times events were found lost (sequence gaps)",
            gaps.clone(),
        );
        registry.register("replays", "Replay requests sent", replays.clone());
        registry.register(
            "replica_restarts",
            "Replica restarts detected from sequence numbers",
            restarts.clone(),
        );
        registry.register(
            "rekey_orphans",
            "Blocks of re-keyed endpoints that could not be translated",
            orphans.clone(),
        );
        registry.register(
            "index_dropped_entries",
            "Index entries refused at --max-entries",
            dropped_entries.clone(),
        );
        registry.register(
            "event_lag_seconds",
            "Time from a batch's timestamp to its application",
            event_lag.clone(),
        );
        registry.register(
            "index_entries",
            "(block, endpoint) entries in the index",
            index_entries.clone(),
        );
        registry.register(
            "index_bytes",
            "Bytes held by the index tables",
            index_bytes.clone(),
        );
        registry.register(
            "booked_keys",
            "Block keys held by live bookings",
            booked_keys.clone(),
        );
        registry.register(
            "lookup_seconds",
            "Lookup handling time",
            lookup_seconds.clone(),
        );
        registry.register(
            "endpoint_alignment",
            "1 for the endpoint's key alignment mode",
            alignment.clone(),
        );
        registry.register(
            "endpoint_misconfigured",
            "1 while the endpoint's vLLM settings do not match the daemon's",
            misconfigured.clone(),
        );
        registry.register(
            "endpoint_kv_cache_unsupported",
            "1 while the endpoint's KV-cache groups are ones kvaffine cannot follow (its matches count as 0)",
            kv_cache_unsupported.clone(),
        );
        registry.register(
            "endpoint_incomplete",
            "1 while the endpoint's index is known to be incomplete",
            incomplete.clone(),
        );
        registry.register(
            "unauthorized_requests",
            "API requests refused for a missing or wrong bearer token (--auth-token-file)",
            unauthorized.clone(),
        );
        registry.register(
            "shared_prefix_lookups",
            "Lookups whose longest match ended where two other booked lookups had within the last second: ranked with the replicas' queues counted twice",
            shared_prefix_lookups.clone(),
        );
        Self {
            registry,
            events_applied,
            decode_errors,
            gaps,
            replays,
            restarts,
            orphans,
            dropped_entries,
            event_lag,
            index_entries,
            index_bytes,
            booked_keys,
            lookup_seconds,
            route_tokenize_seconds,
            route_tokenize_failures,
            alignment,
            misconfigured,
            kv_cache_unsupported,
            incomplete,
            unauthorized,
            shared_prefix_lookups,
            lookups,
            shed,
            salt_probes_held,
            bookings_refused,
            peer_bookings,
            peers,
            outcome_predicted,
            outcome_cached,
            outcome_error,
            outcomes,
            booked_predicted,
            replica_cache_hits,
            prefill_tokens_per_second,
            prefill_overhead_seconds,
            prefill_cached_token_cost,
            prefill_context_cost,
        }
    }
}

impl Metrics {
    /// Creates a newly followed stream's series at 0, so that dashboards see a replica's
    /// gaps, restarts and outcomes from the start (a `rate()` needs the zero).
    /// `endpoint` is the replica's HTTP address, which outcomes and picks name; `scraped`
    /// says the stream is the one its replica's metrics are scraped for (rank 0).
    pub fn follow(&self, label: &EndpointLabel, endpoint: &str, scraped: bool) {
        for family in [
            &self.decode_errors,
            &self.gaps,
            &self.replays,
            &self.restarts,
            &self.orphans,
            &self.dropped_entries,
        ] {
            drop(family.get_or_create(label));
        }
        if scraped {
            drop(self.replica_cache_hits.get_or_create(label));
        }
        for family in [
            &self.misconfigured,
            &self.kv_cache_unsupported,
            &self.incomplete,
        ] {
            drop(family.get_or_create(label));
        }
        let http = EndpointLabel {
            endpoint: endpoint.to_owned(),
        };
        for family in [
            &self.outcome_predicted,
            &self.outcome_cached,
            &self.outcome_error,
            &self.booked_predicted,
        ] {
            drop(family.get_or_create(&http));
        }
        for result in crate::outcomes::RESULTS {
            drop(self.outcomes.get_or_create(&ResultLabel {
                endpoint: endpoint.to_owned(),
                result,
            }));
        }
    }

    /// Counts a lookup ranked for `reason`.
    pub fn count_lookup(&self, reason: kvaffine_core::Reason) {
        self.lookups
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// Counts `n` bookings shared with peers or taken from them, by `outcome`.
    pub fn count_peer_bookings(&self, outcome: &'static str, n: u64) {
        self.peer_bookings
            .get_or_create(&PeerLabel { outcome })
            .inc_by(n);
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
