//! The filter's Envoy stats (`wasmcustom.kvaffine.*`): one counter per outcome, so every
//! request is accounted for, and the latency the filter adds.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Reasons a request is forwarded without a pick, each with its own counter.
const UNPINNED: [&str; 10] = [
    "unparsed-body",
    "invalid-cache-salt",
    "previous-response",
    "unrenderable",
    "no-prompt",
    "body-too-large",
    "body-unreadable",
    "tokenize-failed",
    "index-unavailable",
    "no-candidates",
];

/// Reasons a pick was made.
const ROUTED: [&str; 3] = ["prefix", "load", "saturated"];

/// What happened, as far as counting goes.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// A request reached the filter.
    Request,
    /// Not a routed API (method or path): passed through.
    PassThrough,
    /// Routing is off for this route.
    Disabled,
    /// Forwarded unpinned, for this reason.
    Skipped(&'static str),
    /// The tokenizer failed (the request may still be routed approximately).
    TokenizeFailed,
    /// The index did not answer usefully.
    IndexUnavailable,
    /// Pinned, for this reason.
    Routed(&'static str),
}

impl Outcome {
    /// The `x-kvaffine-reason` value.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Request | Self::PassThrough => "passthrough",
            Self::Disabled => "disabled",
            Self::Skipped(reason) | Self::Routed(reason) => reason,
            Self::TokenizeFailed => "tokenize-failed",
            Self::IndexUnavailable => "index-unavailable",
        }
    }
}

/// The daemon's reason as one of the counted ones.
pub fn routed_reason(reason: &str) -> &'static str {
    ROUTED
        .iter()
        .find(|r| **r == reason)
        .copied()
        .unwrap_or("prefix")
}

/// Metric ids, defined once per VM in `on_configure`.
pub struct Stats {
    requests: Option<u32>,
    passthrough: Option<u32>,
    disabled: Option<u32>,
    unpinned: Vec<(&'static str, Option<u32>)>,
    routed: Vec<(&'static str, Option<u32>)>,
    added_us: Option<u32>,
    tokenize_us: Option<u32>,
    lookup_us: Option<u32>,
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
            passthrough: counter("passthrough"),
            disabled: counter("disabled"),
            unpinned: UNPINNED
                .iter()
                .map(|r| (*r, counter(&format!("unpinned.{r}"))))
                .collect(),
            routed: ROUTED
                .iter()
                .map(|r| (*r, counter(&format!("routed.{r}"))))
                .collect(),
            added_us: define(MetricType::Histogram, "kvaffine.added_latency_us"),
            tokenize_us: define(MetricType::Histogram, "kvaffine.tokenize_us"),
            lookup_us: define(MetricType::Histogram, "kvaffine.lookup_us"),
        }
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

    /// Counts one outcome.
    pub fn count(&self, outcome: Outcome) {
        let find = |table: &[(&'static str, Option<u32>)], reason: &str| {
            table
                .iter()
                .find(|(r, _)| *r == reason)
                .and_then(|(_, id)| *id)
        };
        Self::increment(match outcome {
            Outcome::Request => self.requests,
            Outcome::PassThrough => self.passthrough,
            Outcome::Disabled => self.disabled,
            Outcome::Skipped(reason) => find(&self.unpinned, reason),
            Outcome::TokenizeFailed => find(&self.unpinned, "tokenize-failed"),
            Outcome::IndexUnavailable => find(&self.unpinned, "index-unavailable"),
            Outcome::Routed(reason) => find(&self.routed, reason),
        });
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
}
