//! Did the router's predictions come true: the outcomes the filter reports (its prediction
//! and the cached tokens the replica said it served), kept as metrics, as a short
//! per-replica history for the console's chart, and as the latest decisions.

use std::collections::{HashMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};

use kvaffine_core::outcome::Outcome;
use serde::Serialize;

use crate::metrics::{EndpointLabel, Metrics, ResultLabel};

/// The console's chart resolution.
pub const BUCKET_SECONDS: u64 = 10;
/// Buckets kept per replica: the last 15 minutes.
const BUCKETS: usize = 90;
/// Decisions kept for the console.
const RECENT: usize = 200;
/// The results an outcome is counted under.
pub const RESULTS: [&str; 3] = ["exact", "over", "under"];
/// The label of outcomes naming a replica this daemon does not follow: whatever a filter
/// sends, the series stay one per followed replica.
const OTHER: &str = "other";
/// The longest endpoint, model, reason or mode an outcome may carry.
pub const MAX_FIELD_BYTES: usize = 256;

/// One bucket of one replica's history.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Bucket {
    /// Start of the bucket, Unix milliseconds.
    pub start_ms: u64,
    /// Outcomes in it.
    pub outcomes: u64,
    /// Tokens predicted cached.
    pub predicted_tokens: u64,
    /// Tokens the replica reported cached.
    pub cached_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
}

impl Bucket {
    /// Counts `outcome` in (sums saturate: the figures come from senders).
    fn add(&mut self, outcome: &Outcome) {
        self.outcomes += 1;
        self.predicted_tokens = self
            .predicted_tokens
            .saturating_add(outcome.predicted_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(outcome.cached_tokens);
        self.prompt_tokens = self.prompt_tokens.saturating_add(outcome.prompt_tokens);
    }
}

/// A reported outcome, stamped with when the daemon received it.
#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    /// Unix milliseconds.
    pub at_ms: u64,
    /// What the filter reported.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// The outcomes store behind `POST /v1/outcomes` and `GET /v1/outcomes`.
#[derive(Default)]
pub struct OutcomeLog {
    recent: VecDeque<Decision>,
    series: HashMap<String, VecDeque<Bucket>>,
}

/// `GET /v1/outcomes`.
#[derive(Serialize)]
pub struct OutcomesView {
    /// Width of a bucket.
    pub bucket_seconds: u64,
    /// Latest decisions first.
    pub recent: Vec<Decision>,
    /// Each replica's buckets, oldest first.
    pub series: Vec<Series>,
}

/// One replica's history.
#[derive(Serialize)]
pub struct Series {
    /// `HOST:PORT`.
    pub endpoint: String,
    /// Oldest first; buckets without outcomes are absent.
    pub buckets: Vec<Bucket>,
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis().min(u128::from(u64::MAX)) as u64)
}

impl OutcomeLog {
    /// Records `outcomes`, received at `at`, and counts them in `metrics`; `followed` says
    /// whether an endpoint is one of the daemon's replicas (others count as `other`).
    pub fn record(
        &mut self,
        outcomes: Vec<Outcome>,
        at: SystemTime,
        metrics: &Metrics,
        followed: impl Fn(&str) -> bool,
    ) {
        let at_ms = unix_ms(at);
        let start_ms = at_ms - at_ms % (BUCKET_SECONDS * 1000);
        for mut outcome in outcomes {
            if !followed(&outcome.endpoint) {
                outcome.endpoint = OTHER.to_owned();
            }
            metrics.count_outcome(&outcome);
            let buckets = self.series.entry(outcome.endpoint.clone()).or_default();
            if buckets.back().is_none_or(|b| b.start_ms != start_ms) {
                buckets.push_back(Bucket {
                    start_ms,
                    ..Bucket::default()
                });
                if buckets.len() > BUCKETS {
                    buckets.pop_front();
                }
            }
            if let Some(bucket) = buckets.back_mut() {
                bucket.add(&outcome);
            }
            if self.recent.len() == RECENT {
                self.recent.pop_back();
            }
            self.recent.push_front(Decision { at_ms, outcome });
        }
    }

    /// What the console shows, buckets older than `BUCKETS` from `now` left out.
    pub fn view(&self, now: SystemTime) -> OutcomesView {
        let oldest = unix_ms(now).saturating_sub(BUCKET_SECONDS * 1000 * BUCKETS as u64);
        let mut series: Vec<Series> = self
            .series
            .iter()
            .map(|(endpoint, buckets)| Series {
                endpoint: endpoint.clone(),
                buckets: buckets
                    .iter()
                    .filter(|b| b.start_ms >= oldest)
                    .cloned()
                    .collect(),
            })
            .collect();
        series.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        OutcomesView {
            bucket_seconds: BUCKET_SECONDS,
            recent: self.recent.iter().cloned().collect(),
            series,
        }
    }
}

impl Metrics {
    /// Counts one outcome: predicted and served tokens, their difference, and whether the
    /// prediction was exact, over or under.
    pub fn count_outcome(&self, outcome: &Outcome) {
        let label = EndpointLabel {
            endpoint: outcome.endpoint.clone(),
        };
        let (predicted, cached) = (outcome.predicted_tokens, outcome.cached_tokens);
        self.outcome_predicted
            .get_or_create(&label)
            .inc_by(predicted);
        self.outcome_cached.get_or_create(&label).inc_by(cached);
        self.outcome_error
            .get_or_create(&label)
            .inc_by(predicted.abs_diff(cached));
        let [exact, over, under] = RESULTS;
        let result = match predicted.cmp(&cached) {
            std::cmp::Ordering::Equal => exact,
            std::cmp::Ordering::Greater => over,
            std::cmp::Ordering::Less => under,
        };
        self.outcomes
            .get_or_create(&ResultLabel {
                endpoint: outcome.endpoint.clone(),
                result,
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn outcome(endpoint: &str, predicted: u64, cached: u64) -> Outcome {
        Outcome {
            endpoint: endpoint.into(),
            model: None,
            reason: "prefix".into(),
            mode: "precise".into(),
            predicted_tokens: predicted,
            cached_tokens: cached,
            prompt_tokens: 100,
        }
    }

    #[test]
    fn outcomes_fill_buckets_recent_first_and_metrics() {
        let metrics = Metrics::default();
        let mut log = OutcomeLog::default();
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let followed = |e: &str| e != "c:1";
        let at = |s| t0 + Duration::from_secs(s);
        let both = vec![outcome("a:1", 64, 64), outcome("b:1", 0, 16)];
        log.record(both, t0, &metrics, followed);
        log.record(vec![outcome("a:1", 32, 16)], at(1), &metrics, followed);
        log.record(vec![outcome("a:1", 16, 16)], at(20), &metrics, followed);
        // A replica the daemon does not follow is counted as `other`, not as its own series.
        let strays = vec![outcome("c:1", u64::MAX, 0), outcome("c:1", u64::MAX, 0)];
        log.record(strays, at(21), &metrics, followed);
        let view = log.view(t0 + Duration::from_secs(30));
        assert_eq!(view.recent.len(), 6);
        assert_eq!(view.recent[0].outcome.endpoint, "other");
        assert_eq!(view.recent[2].outcome.predicted_tokens, 16);
        let a = &view.series[0];
        assert_eq!(a.endpoint, "a:1");
        assert_eq!(a.buckets.len(), 2);
        assert_eq!(
            (
                a.buckets[0].outcomes,
                a.buckets[0].predicted_tokens,
                a.buckets[0].cached_tokens
            ),
            (2, 96, 80)
        );
        let text = metrics.render();
        for line in [
            "kvaffined_outcome_predicted_cached_tokens_total{endpoint=\"a:1\"} 112",
            "kvaffined_outcome_cached_tokens_total{endpoint=\"a:1\"} 96",
            "kvaffined_outcome_prediction_error_tokens_total{endpoint=\"a:1\"} 16",
            "kvaffined_outcomes_total{endpoint=\"b:1\",result=\"under\"} 1",
            "kvaffined_outcomes_total{endpoint=\"a:1\",result=\"exact\"} 2",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("c:1"));
        assert_eq!(
            view.series[2].buckets[0].predicted_tokens,
            u64::MAX,
            "saturated, not wrapped"
        );
        // An old history ages out of the view.
        assert!(
            log.view(t0 + Duration::from_secs(3600)).series[0]
                .buckets
                .is_empty()
        );
    }
}
