//! The daemon's shared state, and the one read path everything serves: lookup.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use kvaffine_core::{Candidate, Load};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::bookings::Bookings;
use crate::config::{EndpointSpec, Settings};
use crate::history::History;
use crate::index::{GPU, MAX_SLOTS, PrefixIndex, Slot};
use crate::metrics::{EndpointLabel, Metrics};

/// Everything the ingest threads, scrapers and HTTP handlers share.
pub struct Daemon {
    /// Settings derived from the flags.
    pub settings: Settings,
    /// The prefix index.
    pub index: RwLock<PrefixIndex>,
    /// Live bookings.
    pub bookings: Mutex<Bookings>,
    /// Where approximate (text-derived) keys were routed.
    pub history: Mutex<History>,
    /// Followed endpoints, in the order they were added.
    pub endpoints: RwLock<Vec<Arc<Endpoint>>>,
    /// Exported metrics.
    pub metrics: Metrics,
    /// The process's ZMQ context.
    pub zmq: zmq::Context,
    /// Lookups answered: which replica breaks a tie next.
    pub lookups: std::sync::atomic::AtomicUsize,
    /// The tokens the API requires, when `--auth-token-file` is given.
    pub auth: Option<crate::auth::ApiTokens>,
}

/// One followed replica.
pub struct Endpoint {
    /// What it was configured as.
    pub spec: EndpointSpec,
    /// Its bit in the index.
    pub slot: Slot,
    /// Its metric label.
    pub label: EndpointLabel,
    /// What is known of it now.
    pub status: Mutex<EndpointStatus>,
    /// Set to stop its ingest thread and scraper.
    pub stop: AtomicBool,
}

/// Load as last scraped from the replica's `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ScrapedLoad {
    /// `vllm:num_requests_running`, summed over engines.
    pub running: u32,
    /// `vllm:num_requests_waiting`, summed over engines.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, the highest engine's.
    pub kv_cache_usage: f64,
}

/// The state `/v1/endpoints` shows for one replica.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EndpointStatus {
    /// Caught up with the replica's stream (replayed, or live with no replay socket).
    pub synced: bool,
    /// Why its index is known to be missing events, if it is.
    pub incomplete: Option<String>,
    /// `unknown`, `aligned` or `rekeyed`.
    pub alignment: &'static str,
    /// The next sequence number expected.
    pub next_seq: Option<u64>,
    /// Load from the last successful scrape.
    pub load: Option<ScrapedLoad>,
    /// `model_name` from its metrics.
    pub model: Option<String>,
    /// Why its settings do not match the daemon's, if they do not.
    pub misconfigured: Option<String>,
    /// The mismatch was seen in its events (a scrape that sees none does not clear it).
    #[serde(skip)]
    pub misconfigured_by_events: bool,
    /// Why the last scrape failed, if it did.
    pub scrape_error: Option<String>,
    /// Lag of the last applied batch, from its timestamp.
    pub last_event_lag_ms: Option<f64>,
    /// Entries of its engine-hash map (re-keyed endpoints).
    pub rekey_entries: usize,
    /// Events applied since it was added.
    pub events_applied: u64,
    /// Frames or payloads from it that did not decode, since it was added.
    pub decode_errors: u64,
    /// The last of them, as the decoder said.
    pub last_decode_error: Option<String>,
}

/// `POST /v1/lookup`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    /// The request's block keys (event form), block 0 first.
    pub keys: Vec<u64>,
    /// Only endpoints serving this model (or not yet known to serve another) are ranked.
    #[serde(default)]
    pub model: Option<String>,
    /// Book the first-ranked endpoint for these keys.
    #[serde(default)]
    pub book: Option<BookRequest>,
    /// The keys are text-derived (the filter's approximate mode): match them against
    /// where earlier requests were routed, not against KV events.
    #[serde(default)]
    pub approximate: bool,
}

/// The booking part of a lookup.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BookRequest {
    /// Lifetime in milliseconds (default: `--booking-ttl-ms`).
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// One endpoint in a lookup answer.
#[derive(Debug, Serialize)]
pub struct EndpointMatch {
    /// `HOST:PORT`.
    pub endpoint: String,
    /// Leading keys it holds or has booked.
    pub matched_blocks: u32,
    /// Leading keys its events confirm (without bookings).
    pub indexed_blocks: u32,
    /// Leading keys held in other tiers (`CPU`, ...), by tier.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tiers: BTreeMap<String, u32>,
    /// Scraped running requests.
    pub running: u32,
    /// Scraped waiting requests.
    pub waiting: u32,
    /// Scraped KV-cache usage, 0-1.
    pub kv_cache_usage: f64,
    /// Prefill tokens booked on it and not yet confirmed.
    pub pending_prefill_tokens: u64,
    /// Its index is known to be complete.
    pub complete: bool,
    /// Caught up with its stream.
    pub synced: bool,
    /// Its settings match the daemon's (as far as scraped).
    pub configured: bool,
    /// Its metrics were reachable at the last scrape (or not yet scraped).
    pub reachable: bool,
    /// Key alignment mode.
    pub alignment: &'static str,
}

/// `POST /v1/lookup` answer.
#[derive(Debug, Serialize)]
pub struct LookupResponse {
    /// Every known endpoint.
    pub endpoints: Vec<EndpointMatch>,
    /// Endpoints to try, best first (those serving the request's model).
    pub ranked: Vec<String>,
    /// `complete` when every endpoint's index is, else `incomplete`.
    pub index: &'static str,
    /// Why the first ranked endpoint is first.
    pub reason: &'static str,
    /// The endpoint booked, when booking was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub booked: Option<String>,
}

impl EndpointMatch {
    /// Folds another data-parallel rank of the same replica into this answer: the best
    /// rank's match counts, bookings add up, and anything wrong with one rank shows.
    fn merge_rank(&mut self, other: EndpointMatch) {
        self.matched_blocks = self.matched_blocks.max(other.matched_blocks);
        self.indexed_blocks = self.indexed_blocks.max(other.indexed_blocks);
        for (tier, n) in other.tiers {
            let held = self.tiers.entry(tier).or_default();
            *held = (*held).max(n);
        }
        self.pending_prefill_tokens += other.pending_prefill_tokens;
        self.complete &= other.complete;
        self.synced &= other.synced;
        self.configured &= other.configured;
        if self.alignment != other.alignment {
            self.alignment = "mixed";
        }
    }
}

impl Daemon {
    /// Fresh state for `settings`, its API open to all.
    pub fn new(settings: Settings) -> Self {
        Self::with_auth(settings, None)
    }

    /// Fresh state for `settings`, its API requiring one of `auth`'s tokens.
    pub fn with_auth(settings: Settings, auth: Option<crate::auth::ApiTokens>) -> Self {
        let index = PrefixIndex::new(settings.max_entries);
        let history = History::new(settings.max_entries.min(10_000_000));
        let bookings = Bookings::new(settings.prefill_tokens_per_second);
        Self {
            settings,
            index: RwLock::new(index),
            bookings: Mutex::new(bookings),
            history: Mutex::new(history),
            endpoints: RwLock::new(Vec::new()),
            metrics: Metrics::default(),
            zmq: zmq::Context::new(),
            lookups: std::sync::atomic::AtomicUsize::new(0),
            auth,
        }
    }

    /// A free slot, if fewer than [`MAX_SLOTS`] endpoints are followed.
    pub fn free_slot(&self) -> Option<Slot> {
        let endpoints = self.endpoints.read();
        (0..MAX_SLOTS)
            .filter_map(Slot::new)
            .find(|slot| endpoints.iter().all(|e| e.slot != *slot))
    }

    /// Ready once every endpoint is synced or flagged incomplete.
    pub fn ready(&self) -> bool {
        self.endpoints.read().iter().all(|e| {
            let status = e.status.lock();
            status.synced || status.incomplete.is_some()
        })
    }

    /// Answers a lookup, booking the pick if asked.
    pub fn lookup(&self, request: &LookupRequest, now: Instant) -> LookupResponse {
        let endpoints = self.endpoints.read().clone();
        let mut bookings = self.bookings.lock();
        bookings.expire(now);
        let (matched, indexed, other_tiers) = if request.approximate {
            let routed = self.history.lock().longest_prefixes(&request.keys);
            (routed, routed, Vec::new())
        } else {
            let index = self.index.read();
            let matched = if bookings.is_empty() {
                None
            } else {
                Some(index.longest_prefixes_with(GPU, &request.keys, |k| bookings.holders(k)))
            };
            let indexed = index.longest_prefixes(GPU, &request.keys);
            let tiers: Vec<(String, [u32; MAX_SLOTS])> = index
                .media()
                .filter(|m| *m != GPU)
                .map(|m| (m.to_owned(), index.longest_prefixes(m, &request.keys)))
                .collect();
            (matched.unwrap_or(indexed), indexed, tiers)
        };
        let pending = bookings.pending_tokens(now);
        // One answer per replica: its data-parallel ranks' streams merge into it.
        let mut answers: Vec<EndpointMatch> = Vec::with_capacity(endpoints.len());
        let mut best_slot: Vec<Slot> = Vec::with_capacity(endpoints.len());
        let mut models: Vec<Option<String>> = Vec::with_capacity(endpoints.len());
        for endpoint in &endpoints {
            let slot = endpoint.slot.index();
            let status = endpoint.status.lock();
            let at = |a: &[u32; MAX_SLOTS]| a.get(slot).copied().unwrap_or(0);
            let load = status.load.unwrap_or_default();
            let stream = EndpointMatch {
                endpoint: endpoint.spec.endpoint.clone(),
                matched_blocks: at(&matched),
                indexed_blocks: at(&indexed),
                tiers: other_tiers
                    .iter()
                    .filter(|(_, m)| at(m) > 0)
                    .map(|(name, m)| (name.clone(), at(m)))
                    .collect(),
                running: load.running,
                waiting: load.waiting,
                kv_cache_usage: load.kv_cache_usage,
                pending_prefill_tokens: pending.get(slot).copied().unwrap_or(0),
                complete: status.incomplete.is_none(),
                synced: status.synced,
                configured: status.misconfigured.is_none(),
                reachable: status.scrape_error.is_none(),
                alignment: status.alignment,
            };
            match answers.iter().position(|a| a.endpoint == stream.endpoint) {
                None => {
                    answers.push(stream);
                    best_slot.push(endpoint.slot);
                    models.push(status.model.clone());
                }
                Some(i) => {
                    if let (Some(merged), Some(best)) = (answers.get_mut(i), best_slot.get_mut(i)) {
                        if stream.matched_blocks > merged.matched_blocks {
                            *best = endpoint.slot;
                        }
                        merged.merge_rank(stream);
                    }
                }
            }
        }
        let complete = answers.iter().all(|a| a.complete);
        let mut candidates = Vec::with_capacity(answers.len());
        let mut rankable = Vec::with_capacity(answers.len());
        for (i, (answer, model)) in answers.iter().zip(&models).enumerate() {
            let serves_model = match (&request.model, model) {
                (Some(wanted), Some(served)) => wanted == served,
                _ => true,
            };
            if serves_model {
                rankable.push(i);
                candidates.push(Candidate {
                    matched_blocks: answer.matched_blocks as usize,
                    load: Load {
                        running: answer.running,
                        waiting: answer.waiting,
                        kv_cache_usage: answer.kv_cache_usage,
                        pending_prefill_tokens: answer.pending_prefill_tokens,
                    },
                    usable: answer.reachable,
                });
            }
        }
        let turn = self
            .lookups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (order, reason) = self
            .settings
            .policy
            .rank(request.keys.len(), &candidates, turn);
        let ranked: Vec<String> = order
            .iter()
            .filter_map(|&i| rankable.get(i))
            .filter_map(|&a| answers.get(a))
            .map(|a| a.endpoint.clone())
            .collect();
        let mut booked = None;
        if let (Some(book), Some(&first)) = (&request.book, order.first()) {
            let winner = rankable
                .get(first)
                .and_then(|&a| Some((answers.get(a)?, *best_slot.get(a)?)));
            if let (Some((answer, slot)), Some(candidate)) = (winner, candidates.get(first)) {
                let block_size = self.settings.keys.block_size() as u64;
                // The prefill this request queues on its replica, in uncached-token
                // equivalents: its uncached tokens, its cached ones at their lower cost, and
                // the fixed cost of a request.
                let held = candidate.matched_blocks.min(request.keys.len()) as u64 * block_size;
                let uncached =
                    request.keys.len().saturating_sub(candidate.matched_blocks) as u64 * block_size;
                let work = uncached
                    + (held as f64 * self.settings.policy.cached_token_cost) as u64
                    + self.settings.request_overhead_tokens;
                let ttl = book
                    .ttl_ms
                    .map_or(self.settings.booking_ttl, std::time::Duration::from_millis);
                bookings.book(slot, &request.keys, work, now, ttl);
                if request.approximate {
                    self.history.lock().record(slot, &request.keys);
                }
                booked = Some(answer.endpoint.clone());
            }
        }
        LookupResponse {
            endpoints: answers,
            ranked,
            index: if complete { "complete" } else { "incomplete" },
            reason: reason.as_str(),
            booked,
        }
    }
}
