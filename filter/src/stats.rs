//! The filter's Envoy stats (`wasmcustom.kvaffine.*`): one counter per [`Reason`], so every
//! request is accounted for, and the latency the filter adds. Counter names come from the
//! reasons' own spelling: `routed.<reason>` for a pick, `unpinned.<reason>` for a request
//! forwarded without one, and `passthrough` and `disabled` as they are. Two gauges show
//! what the filter holds, summed over the gateway's VMs (one per worker): its linear
//! memory and its digest cache. With `report_outcomes`, per replica
//! (`kvaffine.endpoint.<host_port>.*`, the address with `.` and `:` as `_`): outcomes
//! measured, tokens predicted cached, tokens the replica reported cached, and their absolute
//! difference; and `outcomes.unmeasured` for answers that carried no cached-token count.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use kvaffine_core::Reason;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// The counter a reason is counted in (below `kvaffine.`).
fn counter_name(reason: Reason) -> String {
    match reason {
        Reason::Passthrough | Reason::Disabled => reason.as_str().to_owned(),
        pinned if pinned.pinned() => format!("routed.{pinned}"),
        unpinned => format!("unpinned.{unpinned}"),
    }
}

/// Metric ids, defined once per VM in `on_configure`.
pub struct Stats {
    requests: Option<u32>,
    reasons: Vec<(Reason, Option<u32>)>,
    added_us: Option<u32>,
    tokenize_us: Option<u32>,
    lookup_us: Option<u32>,
    salt_probe_us: Option<u32>,
    route_us: Option<u32>,
    vm_memory: Option<u32>,
    digest_blocks: Option<u32>,
    /// What this VM last added to the two gauges (memory bytes, cached digests).
    reported: Cell<(u64, u64)>,
    unmeasured: Option<u32>,
    outcomes_dropped: Option<u32>,
    /// Per-replica outcome counters, defined on a replica's first outcome.
    endpoints: RefCell<HashMap<String, EndpointIds>>,
}

/// At most this many replicas get their own outcome counters per VM (a host's stats are
/// never freed): beyond it outcomes still reach the index, uncounted here.
const MAX_ENDPOINT_STATS: usize = 1024;

struct EndpointIds {
    outcomes: Option<u32>,
    predicted: Option<u32>,
    cached: Option<u32>,
    error: Option<u32>,
}

impl EndpointIds {
    fn define(endpoint: &str) -> Self {
        let name: String = endpoint
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let counter = |what: &str| {
            define(
                MetricType::Counter,
                &format!("kvaffine.endpoint.{name}.{what}"),
            )
        };
        Self {
            outcomes: counter("outcomes"),
            predicted: counter("predicted_cached_tokens"),
            cached: counter("cached_tokens"),
            error: counter("prediction_error_tokens"),
        }
    }
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(kind, name).ok()
}

impl Stats {
    /// Defines every metric. A host that refuses one simply does not count it.
    pub fn define() -> Self {
        let counter = |name: &str| define(MetricType::Counter, &format!("kvaffine.{name}"));
        Self {
            requests: counter("requests"),
            reasons: Reason::ALL
                .iter()
                .map(|r| (*r, counter(&counter_name(*r))))
                .collect(),
            added_us: define(MetricType::Histogram, "kvaffine.added_latency_us"),
            tokenize_us: define(MetricType::Histogram, "kvaffine.tokenize_us"),
            lookup_us: define(MetricType::Histogram, "kvaffine.lookup_us"),
            salt_probe_us: define(MetricType::Histogram, "kvaffine.salt_probe_us"),
            route_us: define(MetricType::Histogram, "kvaffine.route_us"),
            vm_memory: define(MetricType::Gauge, "kvaffine.vm_memory_bytes"),
            digest_blocks: define(MetricType::Gauge, "kvaffine.digest_cache_blocks"),
            reported: Cell::new((0, 0)),
            unmeasured: counter("outcomes.unmeasured"),
            outcomes_dropped: counter("outcomes.dropped"),
            endpoints: RefCell::new(HashMap::new()),
        }
    }

    fn add(id: Option<u32>, value: u64) {
        if let (Some(id), Ok(value)) = (id, i64::try_from(value)) {
            let _ = hostcalls::increment_metric(id, value);
        }
    }

    /// Counts one measured outcome of a request pinned to `endpoint`.
    pub fn outcome(&self, endpoint: &str, predicted: u64, cached: u64) {
        let Ok(mut endpoints) = self.endpoints.try_borrow_mut() else {
            return;
        };
        if !endpoints.contains_key(endpoint) && endpoints.len() >= MAX_ENDPOINT_STATS {
            return;
        }
        let ids = endpoints
            .entry(endpoint.to_owned())
            .or_insert_with(|| EndpointIds::define(endpoint));
        Self::increment(ids.outcomes);
        Self::add(ids.predicted, predicted);
        Self::add(ids.cached, cached);
        Self::add(ids.error, predicted.abs_diff(cached));
    }

    /// Counts an answer that said nothing of its cached tokens.
    pub fn unmeasured(&self) {
        Self::increment(self.unmeasured);
    }

    /// Counts outcomes dropped unsent (the index unreachable for long).
    pub fn outcomes_dropped(&self, count: u64) {
        Self::add(self.outcomes_dropped, count);
    }

    fn increment(id: Option<u32>) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn record(id: Option<u32>, value: u64) {
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    /// Counts a request reaching the filter.
    pub fn request(&self) {
        Self::increment(self.requests);
    }

    /// Counts one outcome.
    pub fn count(&self, reason: Reason) {
        let id = self
            .reasons
            .iter()
            .find(|(r, _)| *r == reason)
            .and_then(|(_, id)| *id);
        Self::increment(id);
    }

    /// Time from the request headers to resuming the request.
    pub fn added_latency(&self, us: u64) {
        Self::record(self.added_us, us);
    }

    /// Time of the tokenizer callout.
    pub fn tokenize_latency(&self, us: u64) {
        Self::record(self.tokenize_us, us);
    }

    /// Time of the index callout.
    pub fn lookup_latency(&self, us: u64) {
        Self::record(self.lookup_us, us);
    }

    /// Time of the salt probe (the index callout before tokenizing a salted request).
    pub fn salt_probe_latency(&self, us: u64) {
        Self::record(self.salt_probe_us, us);
    }

    /// A route callout's time (tokenizer, keys and lookup at the index), dispatch to
    /// answer.
    pub fn route_latency(&self, us: u64) {
        Self::record(self.route_us, us);
    }

    /// Brings this VM's share of the two gauges to `memory_bytes` and `digest_blocks`
    /// (Envoy sums every VM's increments into one gauge).
    pub fn footprint(&self, memory_bytes: u64, digest_blocks: u64) {
        let (memory_was, blocks_was) = self.reported.get();
        // A share changes only once the host has taken the increment, so a refused one
        // never leaves the gauge off by it.
        let applied = |id: Option<u32>, now: u64, was: u64| match (
            id,
            i64::try_from(now),
            i64::try_from(was),
        ) {
            _ if now == was => now,
            (Some(id), Ok(n), Ok(w)) if hostcalls::increment_metric(id, n - w).is_ok() => now,
            _ => was,
        };
        self.reported.set((
            applied(self.vm_memory, memory_bytes, memory_was),
            applied(self.digest_blocks, digest_blocks, blocks_was),
        ));
    }
}
