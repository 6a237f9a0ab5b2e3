//! kvaffine's proxy-wasm filter: thin glue between the gateway and `kvaffine-core`.
//!
//! Per request: strip client routing headers; hold the headers and buffer the body; ask a
//! replica's `/tokenize` for the exact tokens; compute vLLM's block keys; ask `kvaffined`
//! which replica holds the longest prefix; pin it; resume. Every failure resumes the
//! request unpinned, so routing can lose affinity but never a request. Decisions are
//! made in `kvaffine_core`; this crate holds what is the gateway's (its configuration's
//! clusters and headers, Envoy against Kong) and moves bytes between core and the host.
//!
//! Host calls go through `proxy_wasm::hostcalls`, which return `Result`s for the statuses
//! a host documents; a few (header setters, `set_property`, resume) still panic on any
//! other status, which would trap the VM and strand the paused request. The filter only
//! makes those calls with arguments it has checked (endpoints are `host:port` with a
//! numeric port before they are pinned), while the request's headers are still held.

// Natively (the docs generator, unit tests) only the configuration is used; the rest runs
// in the gateway's Wasm VM.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

pub mod config;
mod stats;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvaffine_core::api::Api;
use kvaffine_core::config::{Mode, Router};
use kvaffine_core::outcome::{self, Outcome, Outcomes, StreamUsage};
use kvaffine_core::plan::{self, Action as Step, Plan};
use kvaffine_core::protocol::{
    self, Booking, HeldSalts, KeySettings, LookupAnswer, LookupError, LookupRequest, Pick, Query,
    RouteRequest, SaltProbe, TokenizerHints, v1,
};
use kvaffine_core::tokens::TokensPerByte;
use kvaffine_core::{DigestCache, Reason, tokens};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use config::{FilterConfig, Host};
use stats::Stats;

// The SDK's entry point (`_initialize`): registers the root context.
#[cfg(target_arch = "wasm32")]
#[allow(missing_docs)]
mod entry {
    use super::*;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
    }}
}

/// Response headers that say what the filter did.
const ENDPOINT_HEADER: &str = "x-kvaffine-endpoint";
const MATCHED_HEADER: &str = "x-kvaffine-matched-blocks";
const REASON_HEADER: &str = "x-kvaffine-reason";
const MODE_HEADER: &str = "x-kvaffine-mode";
/// Envoy's per-try timeout, which ends with the first response headers.
const PER_TRY_TIMEOUT_HEADER: &str = "x-envoy-upstream-rq-per-try-timeout-ms";
/// Route metadata namespace for per-route settings (`mode`, `tokenize_at`).
const METADATA_NAMESPACE: &str = "kvaffine";

/// Block digests remembered per VM: about 64 k blocks (3 MB), enough for the recent
/// conversations of one worker.
const DIGEST_CACHE_BLOCKS: usize = 65_536;

/// After a daemon answers `/v2/lookup` with 404 (it speaks protocol 1 only), lookups use
/// `/v1/lookup` for this long before protocol 2 is tried again (the daemon may have been
/// upgraded meanwhile).
const PROTOCOL_1_RECHECK: Duration = Duration::from_secs(300);

/// Outcomes waiting to be sent, per VM; past it the oldest are dropped (and counted).
const MAX_QUEUED_OUTCOMES: usize = 4096;
/// Outcomes per `POST /v1/outcomes`.
const OUTCOMES_PER_POST: usize = 512;
/// A non-streamed answer longer than this is not read for its usage (unmeasured).
const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// A streamed event line longer than this is not read (a Responses `response.completed`
/// carries the whole response).
const MAX_EVENT_LINE_BYTES: usize = 1024 * 1024;

/// Outcomes of this VM's requests, oldest first, until the root sends them.
type OutcomeQueue = Rc<RefCell<VecDeque<Outcome>>>;

/// Where this VM's next tokenizer callouts go, from the index's latest answers.
type SharedHints = Rc<RefCell<TokenizerHints>>;

/// Salts this VM tokenizes without probing first, and until when the index is known not
/// to take salt probes (a daemon before them).
#[derive(Default)]
struct SaltMemory {
    held: HeldSalts,
    probes_refused_until: Option<SystemTime>,
    /// What the requests tokenized so far say a request's size is in tokens.
    tokens_per_byte: TokensPerByte,
}

#[derive(Default)]
struct Root {
    config: Option<Rc<FilterConfig>>,
    stats: Option<Rc<Stats>>,
    digests: Option<Rc<RefCell<DigestCache>>>,
    /// Until when the index is known to speak protocol 1 only.
    protocol_1_until: Rc<Cell<Option<SystemTime>>>,
    /// Until when the index is known not to take route callouts (a daemon before them).
    routes_refused_until: Rc<Cell<Option<SystemTime>>>,
    outcomes: OutcomeQueue,
    tokenizer_hints: SharedHints,
    salts: Rc<RefCell<SaltMemory>>,
    /// The `POST /v1/outcomes` in flight: its token, how many outcomes it carries, and
    /// when it was sent (a host that never answers does not stop the batches for good).
    posting: Option<(u32, usize, SystemTime)>,
    /// Until when the index is known not to take outcomes (a daemon before them).
    outcomes_refused_until: Option<SystemTime>,
    /// The last batch failed (logged once, until one succeeds again).
    outcomes_failing: bool,
}

impl Root {
    /// Sends the oldest queued outcomes to the index, one batch at a time.
    fn send_outcomes(&mut self) {
        let (Some(config), Some(stats)) = (&self.config, &self.stats) else {
            return;
        };
        let deadline = Duration::from_millis(config.gateway.timeout_ms.saturating_mul(2));
        match self.posting {
            Some((_, sent, at)) if now().duration_since(at).is_ok_and(|d| d > deadline) => {
                stats.outcomes_dropped(sent as u64);
                self.posting = None;
            }
            Some(_) => return,
            None => {}
        }
        let Ok(mut queue) = self.outcomes.try_borrow_mut() else {
            return;
        };
        if self
            .outcomes_refused_until
            .is_some_and(|until| now() < until)
        {
            // An older daemon: nothing to send them to, so they go (counted).
            stats.outcomes_dropped(queue.len() as u64);
            queue.clear();
            return;
        }
        if queue.is_empty() {
            return;
        }
        let take = queue.len().min(OUTCOMES_PER_POST);
        let batch = Outcomes {
            outcomes: queue.iter().take(take).cloned().collect(),
        };
        // Refused by the host, the batch stays for the next tick (the queue's bound drops
        // the oldest meanwhile).
        if let Some(token) = call_index(config, outcome::OUTCOMES_PATH, &batch.to_json()) {
            queue.drain(..take);
            self.posting = Some((token, take, now()));
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, _: usize, _: usize, _: usize) {
        let Some((_, sent, _)) = self.posting.take_if(|(token, ..)| *token == token_id) else {
            return;
        };
        let status = call_status();
        if matches!(status, Some(200..=299)) {
            if self.outcomes_failing {
                log(LogLevel::Info, "kvaffine: the index takes outcomes again");
            }
            self.outcomes_failing = false;
            // More than a batch waiting (a busy worker): the next goes now, not next tick.
            self.send_outcomes();
            return;
        }
        if let Some(stats) = &self.stats {
            stats.outcomes_dropped(sent as u64);
        }
        match status {
            Some(404) => {
                if self.outcomes_refused_until.is_none() {
                    log(
                        LogLevel::Info,
                        "kvaffine: the index does not take /v1/outcomes (an older kvaffined); outcomes are counted here only",
                    );
                }
                self.outcomes_refused_until = Some(now() + PROTOCOL_1_RECHECK);
            }
            // Once per failing spell: the daemon may be down for a while.
            status if !self.outcomes_failing => {
                self.outcomes_failing = true;
                log(
                    LogLevel::Warn,
                    &format!(
                        "kvaffine: the index refused {sent} outcomes (status {status:?}); dropped and counted until it takes them again"
                    ),
                );
            }
            _ => {}
        }
    }

    fn on_done(&mut self) -> bool {
        // The VM is going (a new filter version, a configuration change): its share of the
        // gauges goes with it.
        if let Some(stats) = &self.stats {
            stats.footprint(0, 0);
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            _ => {
                log(LogLevel::Error, "kvaffine: no plugin configuration");
                return false;
            }
        };
        // The digest cache's fingerprint key must be unknown to clients (who could
        // otherwise craft a block whose fingerprint collides with another's): it comes from
        // the host's random source (WASI `random_get`), never from the clock.
        let secret = match getrandom::u64() {
            Ok(secret) => secret,
            Err(err) => {
                log(
                    LogLevel::Error,
                    &format!("kvaffine: the host's random source (WASI random_get) failed: {err}"),
                );
                return false;
            }
        };
        match FilterConfig::from_json(&bytes) {
            Ok(config) => {
                if config.gateway.index_token.is_none() && config.index_token.is_some() {
                    log(
                        LogLevel::Info,
                        "kvaffine: lookups carry the token from the VM's environment",
                    );
                }
                self.config = Some(Rc::new(config));
                // A new configuration in the same VM starts a new cache: the old one's
                // share of the gauges goes.
                if let Some(old) = &self.stats {
                    old.footprint(0, 0);
                }
                self.stats = Some(Rc::new(Stats::define()));
                // A configuration without outcomes stops the timer an earlier one started.
                let period = if config_reports_outcomes(self.config.as_deref()) {
                    Duration::from_secs(1)
                } else {
                    Duration::ZERO
                };
                let _ = hostcalls::set_tick_period(period);
                self.digests = Some(Rc::new(RefCell::new(DigestCache::new(
                    DIGEST_CACHE_BLOCKS,
                    secret,
                ))));
                true
            }
            Err(err) => {
                log(LogLevel::Error, &format!("kvaffine: {err}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        self.send_outcomes();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let (config, stats) = (self.config.clone()?, self.stats.clone()?);
        Some(Box::new(Request {
            config,
            stats,
            digests: self.digests.clone()?,
            protocol_1_until: self.protocol_1_until.clone(),
            routes_refused_until: self.routes_refused_until.clone(),
            tokenize_at_index: false,
            phase: Phase::Idle,
            started: None,
            mode: Mode::Precise,
            model: None,
            outcome: None,
            api: None,
            outcomes: self.outcomes.clone(),
            tokenizer_hints: self.tokenizer_hints.clone(),
            salts: self.salts.clone(),
            watch: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

enum Phase {
    /// Not routing this request (pass-through, or done).
    Idle,
    /// Headers held, body arriving.
    Buffering(Api),
    /// Waiting for the tokenizer (the body is kept for the approximate fallback).
    Tokenizing {
        token: u32,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        /// The replica the tokenizer hint pinned the callout to, forgotten if it fails.
        hinted: Option<String>,
    },
    /// Waiting for the index to say whether a salted request needs its tokens (the body
    /// and plan are kept to tokenize when it does).
    Probing {
        token: u32,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        salt: u64,
    },
    /// Waiting for the index to tokenize, key and look up (the body and plan are kept to
    /// route the usual way if it cannot).
    Routing {
        token: u32,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        /// The salt probed on the way, if any.
        salt: Option<u64>,
    },
    /// Waiting for the index (the lookup is kept to ask again in protocol 1).
    LookingUp {
        token: u32,
        since: SystemTime,
        request: LookupRequest,
        protocol: Protocol,
    },
}

/// The lookup protocol a callout speaks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Protocol {
    V1,
    V2,
}

fn config_reports_outcomes(config: Option<&FilterConfig>) -> bool {
    config.is_some_and(|c| c.gateway.report_outcomes)
}

/// A routed request's answer, followed for the cached tokens its replica reports.
struct Watch {
    endpoint: String,
    predicted_tokens: u64,
    reason: Reason,
    reading: Reading,
}

enum Reading {
    /// A whole JSON answer, copied as it passes (up to [`MAX_ANSWER_BYTES`]).
    Body(Option<Vec<u8>>),
    /// Server-sent events, line by line.
    Stream(StreamUsage),
}

/// What happened to the request, for the response headers.
struct Decision {
    endpoint: Option<String>,
    matched_blocks: u64,
    reason: Reason,
    mode: Mode,
}

struct Request {
    config: Rc<FilterConfig>,
    stats: Rc<Stats>,
    digests: Rc<RefCell<DigestCache>>,
    protocol_1_until: Rc<Cell<Option<SystemTime>>>,
    routes_refused_until: Rc<Cell<Option<SystemTime>>>,
    /// This request's tokenizer call goes to the index (`tokenize_at_index`, or the
    /// route's `tokenize_at`).
    tokenize_at_index: bool,
    phase: Phase,
    started: Option<SystemTime>,
    mode: Mode,
    model: Option<String>,
    outcome: Option<Decision>,
    /// The API of a routed request (its answer's usage is read by it).
    api: Option<Api>,
    outcomes: OutcomeQueue,
    tokenizer_hints: SharedHints,
    salts: Rc<RefCell<SaltMemory>>,
    watch: Option<Watch>,
}

/// The VM's linear memory: everything the filter holds lives in it.
fn linear_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        core::arch::wasm32::memory_size(0) as u64 * 65_536
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

fn log(level: LogLevel, message: &str) {
    // Logging cannot fail in a way the request should notice.
    let _ = hostcalls::log(level, message);
}

fn now() -> SystemTime {
    hostcalls::get_current_time().unwrap_or(SystemTime::UNIX_EPOCH)
}

fn elapsed_us(since: SystemTime) -> u64 {
    now()
        .duration_since(since)
        .map_or(0, |d| d.as_micros().min(u128::from(u64::MAX)) as u64)
}

fn request_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

/// A per-route setting from route metadata (`filter_metadata.kvaffine.<name>`), if set.
fn route_metadata(name: &str) -> Option<Vec<u8>> {
    let path = vec![
        "xds",
        "route_metadata",
        "filter_metadata",
        METADATA_NAMESPACE,
        name,
    ];
    hostcalls::get_property(path).ok().flatten()
}

/// A per-route mode from route metadata (`filter_metadata.kvaffine.mode`), if set.
fn route_mode() -> Option<Mode> {
    Mode::parse(&route_metadata("mode")?)
}

/// Where a route's tokenizer calls are made, from route metadata
/// (`filter_metadata.kvaffine.tokenize_at`: `index` or `gateway`), if set.
fn route_tokenizes_at_index() -> Option<bool> {
    match route_metadata("tokenize_at")?.as_slice() {
        b"index" => Some(true),
        b"gateway" => Some(false),
        _ => None,
    }
}

impl Request {
    fn gateway(&self) -> &config::GatewayConfig {
        &self.config.gateway
    }

    fn router(&self) -> &Router {
        &self.config.router
    }

    /// Ends routing for this request without a pick, counting why.
    fn unpinned(&mut self, reason: Reason) {
        self.stats.count(reason);
        self.record_unpinned(reason);
    }

    /// Records an unpinned decision already counted.
    fn record_unpinned(&mut self, reason: Reason) {
        self.outcome = Some(Decision {
            endpoint: None,
            matched_blocks: 0,
            reason,
            mode: self.mode,
        });
        self.phase = Phase::Idle;
    }

    /// Lets Envoy retry a streamed request elsewhere when its replica sends no headers in
    /// time; whatever value the request came with is replaced, so no client can lift the
    /// bound or force retries.
    fn bound_stream_headers(&self) {
        let timeout = self.gateway().stream_headers_timeout_ms;
        if self.gateway().host != Host::Envoy || timeout == 0 {
            return;
        }
        let _ = hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            PER_TRY_TIMEOUT_HEADER,
            Some(&timeout.to_string()),
        );
    }

    fn clear_route_cache(&self) {
        // Envoy re-matches the route after header changes; Kong routes before Wasm runs
        // and has no route cache to clear.
        if self.gateway().host == Host::Envoy {
            let _ = hostcalls::call_foreign_function("clear_route_cache", None);
        }
    }

    fn resume(&mut self) {
        if let Some(started) = self.started.take() {
            self.stats.added_latency(elapsed_us(started));
        }
        self.clear_route_cache();
        if hostcalls::resume_http_request().is_err() {
            log(LogLevel::Warn, "kvaffine: cannot resume the request");
        }
    }

    /// Starts following the answer of a request pinned in precise mode.
    fn watch_answer(&mut self) {
        let (Some(decision), Some(api)) = (&self.outcome, self.api) else {
            return;
        };
        let Some(endpoint) = &decision.endpoint else {
            return;
        };
        if !self.gateway().report_outcomes || decision.mode != Mode::Precise {
            return;
        }
        let header = |name| {
            hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
                .ok()
                .flatten()
        };
        if header(":status").is_none_or(|s| s != b"200") {
            return;
        }
        // A retry may have taken the request to another replica (Envoy says which answered;
        // Kong does not, and cannot retry elsewhere): its cache is not the one predicted.
        let answered = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten();
        if answered.is_some_and(|address| address != endpoint.as_bytes()) {
            return;
        }
        let streamed = header("content-type").is_some_and(|t| t.starts_with(b"text/event-stream"));
        self.watch = Some(Watch {
            endpoint: endpoint.clone(),
            predicted_tokens: decision
                .matched_blocks
                .saturating_mul(self.router().config.block_size as u64),
            reason: decision.reason,
            reading: if streamed {
                Reading::Stream(StreamUsage::new(api, MAX_EVENT_LINE_BYTES))
            } else {
                Reading::Body(Some(Vec::new()))
            },
        });
    }

    /// The answer ended: counts what its replica served from cache against the prediction,
    /// and queues the outcome for the index.
    fn answer_ended(&mut self, api: Api, watch: Watch) {
        let usage = match watch.reading {
            Reading::Body(body) => body.and_then(|body| outcome::usage_of(api, &body)),
            Reading::Stream(stream) => stream.finish(),
        };
        let Some(usage) = usage else {
            self.stats.unmeasured();
            return;
        };
        self.stats
            .outcome(&watch.endpoint, watch.predicted_tokens, usage.cached_tokens);
        let Ok(mut queue) = self.outcomes.try_borrow_mut() else {
            return;
        };
        if queue.len() >= MAX_QUEUED_OUTCOMES {
            queue.pop_front();
            self.stats.outcomes_dropped(1);
        }
        queue.push_back(Outcome {
            endpoint: watch.endpoint,
            model: self.model.clone(),
            reason: watch.reason.as_str().to_owned(),
            mode: Mode::Precise.as_str().to_owned(),
            predicted_tokens: watch.predicted_tokens,
            cached_tokens: usage.cached_tokens,
            prompt_tokens: usage.prompt_tokens,
        });
    }

    /// Asks the index about `query`; true if the callout is in flight.
    fn lookup(&mut self, query: Query) -> bool {
        let routing = &self.router().config;
        let request = LookupRequest {
            query,
            model: self.model.clone(),
            book: routing.book.then(Booking::default),
            candidates: 1 + routing.fallbacks,
        };
        let protocol_1 = self
            .protocol_1_until
            .get()
            .is_some_and(|until| now() < until);
        self.send_lookup(
            request,
            if protocol_1 {
                Protocol::V1
            } else {
                Protocol::V2
            },
        )
    }

    fn send_lookup(&mut self, request: LookupRequest, protocol: Protocol) -> bool {
        let (path, body) = match protocol {
            Protocol::V2 => (protocol::LOOKUP_PATH, request.to_json()),
            Protocol::V1 => (v1::LOOKUP_PATH, v1::Request::from(&request).to_json()),
        };
        match call_index(&self.config, path, &body) {
            Some(token) => {
                self.phase = Phase::LookingUp {
                    token,
                    since: now(),
                    request,
                    protocol,
                };
                true
            }
            None => {
                self.unpinned(Reason::IndexUnavailable);
                false
            }
        }
    }

    /// Carries out a plan's next step; true if the request stays paused.
    fn step(&mut self, api: Api, plan: Plan, body: Vec<u8>) -> bool {
        match plan.action.clone() {
            Step::Skip(skip) => {
                self.unpinned(skip.reason());
                false
            }
            Step::LoadOnly => self.lookup(Query::Blocks(Vec::new())),
            Step::Lookup(prompt) => self.lookup(Query::Blocks(prompt.into_servable())),
            Step::Approximate(keys) => self.lookup(Query::Text(keys)),
            Step::Tokenize { .. } if self.routes_at_index() => self.route(api, plan, body),
            Step::Tokenize { .. } => self.tokenize_here(api, plan, body),
        }
    }

    /// The tokenizer call made by the filter itself, after a salt probe where one is due;
    /// true if the request stays paused.
    fn tokenize_here(&mut self, api: Api, plan: Plan, body: Vec<u8>) -> bool {
        match self.salt_to_probe(&plan) {
            Some(salt) => self.probe(api, plan, body, salt),
            None => self.tokenize(api, plan, body),
        }
    }

    /// Whether this request's tokenizer call goes to the index: asked for, and the index
    /// is not known to refuse it (a daemon before route callouts, or protocol 1 only).
    fn routes_at_index(&self) -> bool {
        let refused = |until: &Cell<Option<SystemTime>>| until.get().is_some_and(|u| now() < u);
        self.tokenize_at_index
            && !refused(&self.routes_refused_until)
            && !refused(&self.protocol_1_until)
    }

    /// Hands the tokenizer call to the index, with the salt probe if one is due; true if
    /// the request stays paused.
    fn route(&mut self, api: Api, plan: Plan, body: Vec<u8>) -> bool {
        let Step::Tokenize { path, body: call } = &plan.action else {
            return self.tokenize_here(api, plan, body);
        };
        let salt = self.salt_to_probe(&plan);
        let routing = &self.router().config;
        let request = RouteRequest {
            path: (*path).to_owned(),
            keys: KeySettings::of(self.router(), &plan.extras),
            model: self.model.clone(),
            book: routing.book.then(Booking::default),
            candidates: 1 + routing.fallbacks,
            probe: salt.map(|salt| self.salt_probe(api, &plan, &body, salt)),
            timeout_ms: Some(self.gateway().timeout_ms),
        };
        let payload = request.to_body(call);
        match call_index(&self.config, protocol::ROUTE_PATH, &payload) {
            Some(token) => {
                self.phase = Phase::Routing {
                    token,
                    api,
                    plan,
                    body,
                    since: now(),
                    salt,
                };
                true
            }
            None => self.tokenize_here(api, plan, body),
        }
    }

    /// The index's answer to a route callout: pinned, or routed as the filter would have
    /// without it; true if the request stays paused.
    fn on_routed(
        &mut self,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        salt: Option<u64>,
    ) -> bool {
        self.stats.route_latency(elapsed_us(since));
        match call_status() {
            Some(200) => {}
            // A daemon before route callouts: the filter tokenizes itself for a while.
            Some(404 | 405) => {
                if self.routes_refused_until.get().is_none() {
                    log(
                        LogLevel::Info,
                        "kvaffine: the index does not take /v2/route (an older kvaffined); the filter calls the tokenizer itself",
                    );
                }
                self.routes_refused_until
                    .set(Some(now() + PROTOCOL_1_RECHECK));
                return self.tokenize_here(api, plan, body);
            }
            // This request's body or settings were refused (too large, a key setting the
            // index does not know): the filter's own way still works.
            Some(400 | 413) => return self.tokenize_here(api, plan, body),
            // The index could not tokenize (no replica, an error): as a failed tokenizer
            // call, the text routes it.
            Some(502) => return self.approximate_fallback(api, &plan, &body),
            _ => {
                self.unpinned(Reason::IndexUnavailable);
                return false;
            }
        }
        let Some(answer) = call_body().and_then(|a| protocol::read_route_answer(&a).ok()) else {
            self.unpinned(Reason::IndexUnavailable);
            return false;
        };
        if let (Some(tokens), Ok(mut salts)) = (answer.tokens, self.salts.try_borrow_mut()) {
            salts.tokens_per_byte.learn(body.len(), tokens);
            // Probed and tokenized anyway: a replica holds the salt, so its next requests
            // skip the probe.
            if let Some(salt) = salt {
                salts.held.insert(salt);
            }
        }
        self.note_hint(answer.route.tokenize_at.as_deref());
        self.pin_answer(Some(Ok(answer.route)));
        false
    }

    /// The tag of the request's salt, when the index should be asked about it before
    /// tokenizing (`salt_probes` on): not for a salt it said a replica holds, nor a daemon
    /// that does not know salt probes (or speaks protocol 1).
    fn salt_to_probe(&self, plan: &Plan) -> Option<u64> {
        if !self.gateway().salt_probes {
            return None;
        }
        let salt = plan.extras.cache_salt.as_ref()?.tag();
        let protocol_1 = self
            .protocol_1_until
            .get()
            .is_some_and(|until| now() < until);
        let salts = self.salts.try_borrow().ok()?;
        let refused = salts
            .probes_refused_until
            .is_some_and(|until| now() < until);
        (!protocol_1 && !refused && !salts.held.contains(salt)).then_some(salt)
    }

    /// The salt probe for a request of `salt`.
    fn salt_probe(&self, api: Api, plan: &Plan, body: &[u8], salt: u64) -> SaltProbe {
        let routing = &self.router().config;
        let tokens = self
            .salts
            .try_borrow()
            .ok()
            .map(|salts| salts.tokens_per_byte.estimate(body.len()));
        SaltProbe {
            salt,
            model: self.model.clone(),
            book: routing.book.then(Booking::default),
            candidates: 1 + routing.fallbacks,
            tokens,
            text: Some(plan::probe_text_keys(self.router(), api, body, plan).unwrap_or_default()),
        }
    }

    /// Asks the index whether a replica holds `salt`; true if the request stays paused.
    fn probe(&mut self, api: Api, plan: Plan, body: Vec<u8>, salt: u64) -> bool {
        let probe = self.salt_probe(api, &plan, &body, salt);
        match call_index(&self.config, protocol::SALT_PATH, &probe.to_json()) {
            Some(token) => {
                self.phase = Phase::Probing {
                    token,
                    api,
                    plan,
                    body,
                    since: now(),
                    salt,
                };
                true
            }
            None => self.tokenize(api, plan, body),
        }
    }

    /// The index's answer to a salt probe: pinned at once, or tokenized as without the
    /// probe (also when the probe failed); true if the request stays paused.
    fn on_probed(
        &mut self,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        salt: u64,
    ) -> bool {
        self.stats.salt_probe_latency(elapsed_us(since));
        let status = call_status();
        // 404: a daemon before salt probes; 400: one before this probe's fields.
        if matches!(status, Some(400 | 404)) {
            if let Ok(mut salts) = self.salts.try_borrow_mut() {
                if salts.probes_refused_until.is_none() {
                    log(
                        LogLevel::Info,
                        "kvaffine: the index does not take this filter's /v2/salt probes; salted requests are tokenized first",
                    );
                }
                salts.probes_refused_until = Some(now() + PROTOCOL_1_RECHECK);
            }
            return self.tokenize(api, plan, body);
        }
        let answer = call_body()
            .filter(|_| status == Some(200))
            .and_then(|answer| protocol::read_salt_answer(&answer).ok());
        let Some(answer) = answer else {
            return self.tokenize(api, plan, body);
        };
        match answer.route {
            Some(route) => {
                self.note_hint(route.tokenize_at.as_deref());
                self.pin_answer(Some(Ok(route)));
                false
            }
            None => {
                self.note_hint(answer.tokenize_at.as_deref());
                if let Ok(mut salts) = self.salts.try_borrow_mut() {
                    salts.held.insert(salt);
                }
                self.tokenize(api, plan, body)
            }
        }
    }

    /// Notes the index's tokenizer hint for this request's model.
    fn note_hint(&self, tokenize_at: Option<&str>) {
        if let Ok(mut hints) = self.tokenizer_hints.try_borrow_mut() {
            hints.note(self.model.as_deref(), tokenize_at);
        }
    }

    /// Sends the plan's tokenizer callout; true if the request stays paused.
    fn tokenize(&mut self, api: Api, plan: Plan, body: Vec<u8>) -> bool {
        let gateway = self.gateway();
        // On Envoy the tokenizer cluster's override_host policy reads the same header as
        // the pool's; a cluster without it ignores the header and balances as before.
        // Kong calls its configured target.
        let hint = match gateway.host {
            Host::Envoy => self
                .tokenizer_hints
                .try_borrow()
                .ok()
                .and_then(|h| h.get(self.model.as_deref()).map(str::to_owned)),
            Host::Kong => None,
        };
        let pin = hint
            .as_deref()
            .map(|endpoint| (gateway.endpoint_header.as_str(), endpoint));
        let token = match &plan.action {
            Step::Tokenize { path, body: call } => callout(
                gateway,
                &gateway.tokenizer_cluster,
                gateway.tokenizer_authority(),
                path,
                call,
                None,
                pin,
            ),
            _ => None,
        };
        match token {
            Some(token) => {
                self.phase = Phase::Tokenizing {
                    token,
                    api,
                    plan,
                    body,
                    since: now(),
                    hinted: hint,
                };
                true
            }
            None => self.approximate_fallback(api, &plan, &body),
        }
    }

    /// Tokenizing failed: route on text-derived keys rather than not at all.
    fn approximate_fallback(&mut self, api: Api, plan: &Plan, body: &[u8]) -> bool {
        self.stats.count(Reason::TokenizeFailed);
        match plan::approximate_fallback(self.router(), api, body, plan) {
            Some(keys) => {
                self.mode = Mode::Approximate;
                self.lookup(Query::Text(keys))
            }
            None => {
                // Counted above.
                self.record_unpinned(Reason::TokenizeFailed);
                false
            }
        }
    }

    /// Envoy's override_host reads the ranked list from a request header; Kong balances
    /// after Wasm runs and takes one `host:port` from the `kong.service.target` property.
    fn pin(&mut self, pick: &Pick) -> bool {
        match self.gateway().host {
            Host::Envoy => {
                let header = self.gateway().endpoint_header.clone();
                let value = pick.header_value();
                hostcalls::set_map_value(MapType::HttpRequestHeaders, &header, Some(&value)).is_ok()
            }
            Host::Kong => pick.endpoints.first().is_some_and(|first| {
                hostcalls::set_property(vec!["kong", "service", "target"], Some(first.as_bytes()))
                    .is_ok()
            }),
        }
    }

    fn on_tokenized(
        &mut self,
        api: Api,
        plan: Plan,
        body: Vec<u8>,
        since: SystemTime,
        hinted: Option<String>,
    ) -> bool {
        self.stats.tokenize_latency(elapsed_us(since));
        let ok = call_status() == Some(200);
        if let (false, Some(endpoint), Ok(mut hints)) =
            (ok, hinted, self.tokenizer_hints.try_borrow_mut())
        {
            hints.forget(self.model.as_deref(), &endpoint);
        }
        let prompt = call_body().filter(|_| ok).and_then(|answer| {
            // The VM is single-threaded; a busy cache (never expected) just means no reuse.
            let mut cache = self.digests.try_borrow_mut().ok();
            tokens::keys_from_tokenize(self.router(), &plan.extras, &answer, cache.as_deref_mut())
                .ok()
        });
        match prompt {
            Some(prompt) => {
                if let Ok(mut salts) = self.salts.try_borrow_mut() {
                    salts.tokens_per_byte.learn(body.len(), prompt.tokens);
                }
                self.lookup(Query::Blocks(prompt.into_servable()))
            }
            None => self.approximate_fallback(api, &plan, &body),
        }
    }

    /// Reads the index's answer; true if the request stays paused (asked again in
    /// protocol 1).
    fn on_looked_up(
        &mut self,
        since: SystemTime,
        request: LookupRequest,
        protocol: Protocol,
    ) -> bool {
        self.stats.lookup_latency(elapsed_us(since));
        let status = call_status();
        if status == Some(404) && protocol == Protocol::V2 {
            // A daemon of the release before protocol 2.
            if self.protocol_1_until.get().is_none() {
                log(
                    LogLevel::Info,
                    "kvaffine: the index does not know /v2/lookup; using /v1/lookup",
                );
            }
            self.protocol_1_until.set(Some(now() + PROTOCOL_1_RECHECK));
            return self.send_lookup(request, Protocol::V1);
        }
        let answer = call_body()
            .filter(|_| status == Some(200))
            .map(|body| match protocol {
                Protocol::V2 => protocol::read_answer(&body),
                Protocol::V1 => v1::read_answer(&body),
            });
        if let Some(Ok(answer)) = &answer {
            self.note_hint(answer.tokenize_at.as_deref());
        }
        self.pin_answer(answer);
        false
    }

    /// Pins the index's answer (None: it did not answer usefully).
    fn pin_answer(&mut self, answer: Option<Result<LookupAnswer, LookupError>>) {
        let fallbacks = self.router().config.fallbacks;
        let pick = answer.map(|a| a.and_then(|a| Pick::from_answer(&a, fallbacks)));
        match pick {
            // The index answered, but no replica can take the request.
            Some(Err(LookupError::Empty)) => self.unpinned(Reason::NoCandidates),
            Some(Ok(pick)) if self.pin(&pick) => {
                self.stats.count(pick.reason);
                self.outcome = Some(Decision {
                    endpoint: pick.endpoints.first().cloned(),
                    matched_blocks: pick.matched_blocks,
                    reason: pick.reason,
                    mode: self.mode,
                });
                self.phase = Phase::Idle;
            }
            _ => self.unpinned(Reason::IndexUnavailable),
        }
    }
}

/// Starts a POST callout to the index (with its bearer token, if any); its token, or None
/// if the host refused it.
fn call_index(config: &FilterConfig, path: &str, body: &[u8]) -> Option<u32> {
    let gateway = &config.gateway;
    callout(
        gateway,
        &gateway.index_cluster,
        gateway.index_authority(),
        path,
        body,
        config.index_token.as_deref(),
        None,
    )
}

/// Starts a POST callout, with `pin` (header, endpoint) choosing the cluster's member
/// where its policy reads it; its token, or None if the host refused it.
fn callout(
    gateway: &config::GatewayConfig,
    cluster: &str,
    authority: &str,
    path: &str,
    body: &[u8],
    bearer: Option<&str>,
    pin: Option<(&str, &str)>,
) -> Option<u32> {
    let authorization = bearer.map(|token| format!("Bearer {token}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/json"),
    ];
    if let Some(authorization) = &authorization {
        headers.push(("authorization", authorization));
    }
    headers.extend(pin);
    let timeout = Duration::from_millis(gateway.timeout_ms);
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout).ok()
}

fn call_status() -> Option<u16> {
    hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
}

fn call_body() -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, usize::MAX)
        .ok()
        .flatten()
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Tokenizing {
                token,
                api,
                plan,
                body,
                since,
                hinted,
            } if token == token_id => {
                if self.on_tokenized(api, plan, body, since, hinted) {
                    return;
                }
            }
            Phase::Probing {
                token,
                api,
                plan,
                body,
                since,
                salt,
            } if token == token_id => {
                if self.on_probed(api, plan, body, since, salt) {
                    return;
                }
            }
            Phase::Routing {
                token,
                api,
                plan,
                body,
                since,
                salt,
            } if token == token_id => {
                if self.on_routed(api, plan, body, since, salt) {
                    return;
                }
            }
            Phase::LookingUp {
                token,
                since,
                request,
                protocol,
            } if token == token_id => {
                if self.on_looked_up(since, request, protocol) {
                    return;
                }
            }
            other => {
                // A late answer to a callout this request no longer waits for.
                self.phase = other;
                return;
            }
        }
        self.resume();
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        // Clients never choose replicas or pools: strip what only kvaffine may set, on
        // every request, whatever happens next.
        for name in [
            self.gateway().endpoint_header.as_str(),
            self.gateway().model_header.as_str(),
        ] {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
        }
        // Nor how long Envoy waits on a replica before trying the next: only the filter's
        // own bound for streams (`stream_headers_timeout_ms`) is set.
        if self.gateway().host == Host::Envoy {
            let _ =
                hostcalls::remove_map_value(MapType::HttpRequestHeaders, PER_TRY_TIMEOUT_HEADER);
        }
        self.stats.request();
        let cached = self.digests.try_borrow().map_or(0, |cache| cache.len());
        self.stats.footprint(linear_memory_bytes(), cached as u64);
        // Kong has no route metadata: a route's mode is its own filter configuration.
        let per_route = match self.gateway().host {
            Host::Envoy => route_mode(),
            Host::Kong => None,
        };
        self.mode = per_route.unwrap_or(self.router().config.mode);
        self.tokenize_at_index = match self.gateway().host {
            Host::Envoy => route_tokenizes_at_index(),
            Host::Kong => None,
        }
        .unwrap_or(self.gateway().tokenize_at_index);
        if self.mode == Mode::Off {
            self.unpinned(Reason::Disabled);
            return Action::Continue;
        }
        let is_post = request_header(":method").is_some_and(|m| m == b"POST");
        let api = request_header(":path").and_then(|p| self.router().api(&p));
        // Kong never says end of stream here, and may not call the body callback for an
        // empty body: a declared empty body has no prompt, whatever the host says.
        let empty = || request_header("content-length").is_some_and(|l| l == b"0");
        match (is_post, api) {
            (true, Some(api)) if !end_of_stream && !empty() => {
                self.started = Some(now());
                self.api = Some(api);
                self.phase = Phase::Buffering(api);
                Action::Pause
            }
            (true, Some(_)) => {
                self.unpinned(Reason::NoPrompt);
                Action::Continue
            }
            _ => {
                self.unpinned(Reason::Passthrough);
                Action::Continue
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Phase::Buffering(api) = self.phase else {
            return Action::Continue;
        };
        if body_size > self.gateway().max_body_bytes {
            self.unpinned(Reason::BodyTooLarge);
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(Some(body)) => body,
            _ => {
                self.unpinned(Reason::BodyUnreadable);
                return Action::Continue;
            }
        };
        let plan = plan::plan(self.router(), api, self.mode, &body);
        if let Some(model) = &plan.model {
            let header = self.gateway().model_header.clone();
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &header, Some(model));
        }
        self.model = plan.model.clone();
        if plan.streamed {
            self.bound_stream_headers();
        }
        if self.step(api, plan, body) {
            return Action::Pause;
        }
        self.started = None;
        self.clear_route_cache();
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if let Some(decision) = &self.outcome {
            let set = |name: &str, value: &str| {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
            };
            if let Some(endpoint) = &decision.endpoint {
                set(ENDPOINT_HEADER, endpoint);
                set(MATCHED_HEADER, &decision.matched_blocks.to_string());
            }
            set(REASON_HEADER, decision.reason.as_str());
            set(MODE_HEADER, decision.mode.as_str());
        }
        if !end_of_stream {
            self.watch_answer();
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(watch) = &mut self.watch else {
            return Action::Continue;
        };
        // Returning Continue each time, the buffer holds only this chunk.
        let chunk = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        match &mut watch.reading {
            Reading::Body(body) => {
                if let Some(copy) = body {
                    if copy.len() + chunk.len() > MAX_ANSWER_BYTES {
                        *body = None;
                    } else {
                        copy.extend_from_slice(&chunk);
                    }
                }
            }
            Reading::Stream(stream) => stream.feed(&chunk),
        }
        if end_of_stream {
            if let (Some(watch), Some(api)) = (self.watch.take(), self.api) {
                self.answer_ended(api, watch);
            }
        }
        Action::Continue
    }
}
