//! The daemon's shared state, and the one read path everything serves: lookup, a
//! read-only [ranking](Daemon::rank) and a separate [booking](Daemon::book) step.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvaffine_core::approximate::TextKey;
use kvaffine_core::protocol::{self, LookupAnswer, LookupRequest, Query, SaltAnswer, SaltProbe};
use kvaffine_core::{BlockKey, Candidate, Load, PrefillSpeed, Reason};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::backlog::{Backlogs, ConfirmedBy};
use crate::bookings::{Bookings, SaltBookings};
use crate::config::{EndpointSpec, Settings};
use crate::history::History;
use crate::hybrid::{Layout, Rule, hybrid_hit};
use crate::index::{Depths, GPU, Group, MAX_SLOTS, PrefixIndex, Slot, longest_prefixes_by};
use crate::metrics::{EndpointLabel, Metrics};
use crate::peers::{Held, PeerBooking};
use crate::slots::SlotSet;
use crate::speed::{Measurement, SpeedLearner, SpeedSource, SpeedView};

/// Everything the ingest threads, scrapers and HTTP handlers share.
pub struct Daemon {
    /// Settings derived from the flags.
    pub settings: Settings,
    /// The prefix index.
    pub index: RwLock<PrefixIndex>,
    /// Live bookings of precise lookups.
    pub bookings: RwLock<Bookings>,
    /// Where salts no replica's events show yet were sent.
    pub salt_bookings: Mutex<SaltBookings>,
    /// The prefill every pick queued on its replica.
    pub backlogs: Mutex<Backlogs>,
    /// Each slot's prefill speed, as [`refresh_speeds`](Self::refresh_speeds) last set it.
    pub speeds: RwLock<Vec<SpeedView>>,
    /// A scrape changed a measured speed since the last refresh.
    speeds_stale: AtomicBool,
    /// When the speeds were last refreshed.
    speeds_refreshed: Mutex<Option<Instant>>,
    /// Where approximate (text-derived) keys were routed.
    pub history: RwLock<History>,
    /// Followed endpoints, in the order they were added; replaced whole when one is added
    /// or removed, so a ranking keeps the list it ranked and names its picks from it.
    pub endpoints: RwLock<Arc<Vec<Arc<Endpoint>>>>,
    /// Exported metrics.
    pub metrics: Metrics,
    /// ZMQ contexts, each for [`STREAMS_PER_CONTEXT`] slots (see [`Daemon::zmq`]).
    zmq: [zmq::Context; MAX_SLOTS / STREAMS_PER_CONTEXT],
    /// Lookups answered: which replica breaks a tie next.
    pub lookups: std::sync::atomic::AtomicUsize,
    /// The tokens the API requires, when `--auth-token-file` is given.
    pub auth: Option<crate::auth::ApiTokens>,
    /// Where bookings made here are queued for the peers, and who they are (`--peer`, the
    /// config file's `peers`), when either is given.
    pub peers: std::sync::OnceLock<crate::peers::Peering>,
    /// What the peers had measured of each replica (by `HOST:PORT`) when this daemon
    /// started: its speed until this daemon has measured the replica itself.
    pub peer_speeds: Mutex<HashMap<String, PrefillSpeed>>,
    /// The live bookings held here, for a peer that starts (kept only with peers).
    pub ledger: Mutex<crate::peers::Ledger>,
    /// Outcomes the filters reported: predictions against what replicas served.
    pub outcomes: Mutex<crate::outcomes::OutcomeLog>,
    /// This run's random name, sent to peers ([`crate::peers::INSTANCE_HEADER`]) so that a
    /// daemon listed among its own peers finds itself.
    pub instance: String,
    /// Where recent lookups' longest matches ended: which prefixes are in demand.
    pub recent_prefixes: Mutex<crate::demand::RecentPrefixes>,
    /// Set while a starting daemon takes its peers' bookings: lookups wait
    /// ([`restored`](Self::restored)).
    pub restoring: tokio::sync::watch::Sender<bool>,
}

/// A random name for one run of a daemon: the OS-seeded keys of std's hasher over the
/// process and the clock.
fn new_instance() -> String {
    let run = (
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let hash =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), run);
    format!("{hash:016x}")
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
    /// Its ingest thread, joined when the endpoint is removed.
    pub ingest: Mutex<Option<std::thread::JoinHandle<()>>>,
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
    /// Its `vllm:prefix_cache_hits_total` at the last scrape.
    #[serde(skip)]
    pub prefix_cache_hits: Option<f64>,
    /// Frames or payloads from it that did not decode, since it was added.
    pub decode_errors: u64,
    /// The last of them, as the decoder said.
    pub last_decode_error: Option<String>,
    /// Its blocks refused by the index (its share of `--max-entries` held, or the index
    /// full), since it was added.
    pub dropped_entries: u64,
    /// Its event stream's connection went down and has not come back (the replica stopped,
    /// crashed or is restarting): it is ranked after every replica that can take traffic.
    pub events_disconnected: bool,
    /// The KV-cache groups its events have named (kind, window, block size), in order.
    pub kv_cache_groups: Layout,
    /// Why kvaffine cannot predict its cache hits from those groups, if it cannot: its
    /// matches then count as 0.
    pub kv_cache_unsupported: Option<String>,
    /// How lookups read its groups.
    #[serde(skip)]
    pub rule: Arc<Rule>,
    /// What its scrapes taught about its prefill speed.
    #[serde(skip)]
    pub speed: SpeedLearner,
}

/// One endpoint in a ranking, as `/v1/lookup` answers it.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointMatch {
    /// `HOST:PORT`.
    pub endpoint: String,
    /// What the lookup found of it.
    #[serde(flatten)]
    pub found: Found,
}

/// What a lookup found of one replica, its name aside: a ranking names only the replicas
/// it answers with (a thousand names copied per lookup cost more than ranking them).
#[derive(Clone, Debug, Serialize)]
pub struct Found {
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
    /// Its `/metrics` and `/health` both answered at the last scrape (or it is not yet
    /// scraped).
    pub reachable: bool,
    /// Its event stream is connected (or has not been lost since it was added).
    pub connected: bool,
    /// Key alignment mode.
    pub alignment: &'static str,
}

/// `POST /v1/lookup` answer (protocol 1: every endpoint's whole record).
#[derive(Debug, Serialize)]
pub struct LookupResponse {
    /// Every known endpoint.
    pub endpoints: Vec<EndpointMatch>,
    /// Endpoints to try, best first (those serving the request's model).
    pub ranked: Vec<String>,
    /// `complete` when every endpoint's index is, else `incomplete`.
    pub index: &'static str,
    /// Why the first ranked endpoint is first.
    pub reason: Reason,
    /// The endpoint booked, when booking was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub booked: Option<String>,
}

/// The longest a measured speed waits to be ranked on.
pub const SPEED_REFRESH_GAP: std::time::Duration = std::time::Duration::from_millis(50);

/// What [`Daemon::refresh_speeds`] gathers of one replica, from its best-sampled rank.
#[derive(Clone, Copy)]
struct ReplicaFigures {
    /// What it measured, for the fleet's speeds.
    measurement: Measurement,
    /// Where its speed comes from when its metrics have measured nothing here yet: a
    /// peer's figures or its events.
    borrowed: Option<SpeedSource>,
    /// How many data-parallel ranks it has.
    ranks: usize,
}

/// Event streams whose sockets share a ZMQ context: each takes up to four (its events,
/// the two ends of their monitor, its replay), within libzmq's 1,023 per context with room
/// for sockets closing in the background.
const STREAMS_PER_CONTEXT: usize = 128;

/// One replica as a lookup sees it.
struct Replica {
    /// Its first stream's place in the ranking's endpoint list (where its name is).
    at: usize,
    /// What `/v1/lookup` shows of it.
    record: Found,
    /// The slot of its best-matching data-parallel rank: where a booking goes.
    best_slot: Slot,
    /// That rank's number (what a peer knows the slot by).
    best_rank: u32,
    /// That slot's window groups, if it has any.
    windows: Option<Windows>,
    /// It serves the request's model, or may (its metrics name none, or the request none).
    serves_model: bool,
    /// How fast it prefills.
    speed: PrefillSpeed,
}

impl Replica {
    /// What the pick policy weighs of it.
    fn candidate(&self) -> Candidate {
        Candidate {
            matched_blocks: self.record.matched_blocks as usize,
            load: Load {
                running: self.record.running,
                waiting: self.record.waiting,
                kv_cache_usage: self.record.kv_cache_usage,
                pending_prefill_tokens: self.record.pending_prefill_tokens,
            },
            usable: self.record.reachable,
            gone: !self.record.connected,
            speed: self.speed,
        }
    }
}

/// How far each slot matches a request's keys.
struct Matches {
    /// GPU tier, bookings included.
    matched: Depths,
    /// GPU tier, events only.
    indexed: Depths,
    /// Other tiers, events only (full-attention groups).
    tiers: Vec<(String, Depths)>,
    /// What booking a hybrid slot must credit, by slot number (hybrid slots only).
    windows: Vec<Option<Windows>>,
}

/// A hybrid replica's answer, kept to book what the request will leave in its window
/// groups.
#[derive(Clone, Copy, Debug)]
struct Windows {
    /// Leading blocks its full-attention groups hold, bookings included.
    full: u32,
    /// The most blocks before a hit point any of its window groups needs.
    needed: usize,
}

/// A lookup's ranking, before anything is booked.
pub struct Ranking {
    /// The endpoints ranked, where the replicas' names are.
    endpoints: Arc<Vec<Arc<Endpoint>>>,
    /// One per replica (its data-parallel ranks merged).
    replicas: Vec<Replica>,
    /// Replicas serving the request's model, best first.
    order: Vec<usize>,
    /// Why the first is first.
    pub reason: Reason,
    /// Every endpoint's index is complete.
    pub complete: bool,
    /// Where a request with nothing cached would go first (the filter's tokenizer hint).
    pub tokenize_at: Option<String>,
    /// The key the longest match ended at, if any replica matched.
    ended_at: Option<u64>,
    /// How much that prefix was in demand.
    demand: kvaffine_core::Demand,
}

impl Ranking {
    /// `replica`'s `HOST:PORT`.
    fn name(&self, replica: &Replica) -> &str {
        name_in(&self.endpoints, replica)
    }

    /// The protocol-2 answer: the first `candidates` only.
    pub fn answer(&self, candidates: usize, booked: Option<String>) -> LookupAnswer {
        LookupAnswer {
            candidates: self
                .order
                .iter()
                .take(candidates)
                .filter_map(|&i| self.replicas.get(i))
                .map(|r| protocol::Candidate {
                    endpoint: self.name(r).to_owned(),
                    matched_blocks: r.record.indexed_blocks,
                })
                .collect(),
            reason: self.reason,
            complete: self.complete,
            booked,
            tokenize_at: self.tokenize_at.clone(),
        }
    }

    /// The protocol-1 answer: every record.
    pub fn into_v1(self, booked: Option<String>) -> LookupResponse {
        let ranked = self
            .order
            .iter()
            .filter_map(|&i| self.replicas.get(i))
            .map(|r| self.name(r).to_owned())
            .collect();
        let names = &self.endpoints;
        let endpoints = self
            .replicas
            .into_iter()
            .map(|r| EndpointMatch {
                endpoint: name_in(names, &r).to_owned(),
                found: r.record,
            })
            .collect();
        LookupResponse {
            endpoints,
            ranked,
            index: if self.complete {
                "complete"
            } else {
                "incomplete"
            },
            reason: self.reason,
            booked,
        }
    }
}

/// `replica`'s `HOST:PORT`, in the `endpoints` it was ranked from.
fn name_in<'a>(endpoints: &'a [Arc<Endpoint>], replica: &Replica) -> &'a str {
    endpoints
        .get(replica.at)
        .map_or("", |endpoint| endpoint.spec.endpoint.as_str())
}

impl Found {
    /// Folds another data-parallel rank of the same replica into this answer: the best
    /// rank's match counts, bookings add up, and anything wrong with one rank shows.
    fn merge_rank(&mut self, other: Found) {
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
        self.connected &= other.connected;
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
        let initial = crate::speed::unmeasured(settings.speed_flags);
        let backlogs = Backlogs::new(initial.tokens_per_second);
        let bookings = Bookings::new(settings.max_booked_keys);
        Self {
            settings,
            index: RwLock::new(index),
            bookings: RwLock::new(bookings),
            salt_bookings: Mutex::default(),
            outcomes: Mutex::default(),
            backlogs: Mutex::new(backlogs),
            speeds: RwLock::new(vec![initial; MAX_SLOTS]),
            speeds_stale: AtomicBool::new(false),
            speeds_refreshed: Mutex::new(None),
            history: RwLock::new(history),
            endpoints: RwLock::new(Arc::new(Vec::new())),
            metrics: Metrics::default(),
            zmq: std::array::from_fn(|_| zmq::Context::new()),
            lookups: std::sync::atomic::AtomicUsize::new(0),
            auth,
            peers: std::sync::OnceLock::new(),
            ledger: Mutex::default(),
            peer_speeds: Mutex::default(),
            instance: new_instance(),
            restoring: tokio::sync::watch::channel(false).0,
            recent_prefixes: Mutex::default(),
        }
    }

    /// The ZMQ context `slot`'s sockets live in. libzmq allows 1,023 sockets per context
    /// and a stream takes up to four, so a thousand streams cannot share one; a context
    /// starts its I/O thread only with its first socket, so a small fleet runs one.
    pub fn zmq(&self, slot: Slot) -> &zmq::Context {
        // Every slot is below MAX_SLOTS, so its context exists.
        &self.zmq[slot.index() / STREAMS_PER_CONTEXT]
    }

    /// A free slot, if fewer than [`MAX_SLOTS`] endpoints are followed.
    pub fn free_slot(&self) -> Option<Slot> {
        let used: SlotSet = self.endpoints.read().iter().map(|e| e.slot).collect();
        used.first_absent()
    }

    /// Returns once this daemon is not taking its peers' bookings (at start, at most
    /// [`crate::peers::RESTORE_GATE`]): a lookup answered before would miss them.
    pub async fn restored(&self) {
        if !*self.restoring.borrow() {
            return;
        }
        let mut restoring = self.restoring.subscribe();
        // The sender lives as long as the daemon: the wait ends only when it is cleared.
        let _ = restoring.wait_for(|busy| !*busy).await;
    }

    /// Whether bookings go to any peer now.
    pub fn has_peers(&self) -> bool {
        self.peers.get().is_some_and(|p| !p.list.is_empty())
    }

    /// A replica's measured speed may have changed (a scraper just read its metrics, or its
    /// events confirmed a timed pick before its metrics measured it): the
    /// speeds are refreshed now, or by [`refresh_stale_speeds`](Self::refresh_stale_speeds)
    /// within [`SPEED_REFRESH_GAP`] if they were refreshed less than that ago. A refresh
    /// reads every replica, so a thousand scrapers refreshing after each of their scrapes
    /// cost a core; two replicas are refreshed after every scrape, as before.
    pub fn speeds_changed(&self, now: Instant) {
        self.speeds_stale.store(true, Ordering::Relaxed);
        let due = self
            .speeds_refreshed
            .lock()
            .is_none_or(|last| now.saturating_duration_since(last) >= SPEED_REFRESH_GAP);
        if due {
            self.refresh_speeds(now);
        }
    }

    /// Refreshes the speeds if a scrape changed them since the last refresh (`serve` calls
    /// it every [`SPEED_REFRESH_GAP`]).
    pub fn refresh_stale_speeds(&self, now: Instant) {
        if self.speeds_stale.load(Ordering::Relaxed) {
            self.refresh_speeds(now);
        }
    }

    /// Sets every slot's prefill speed from what each replica measured (a replica's
    /// data-parallel ranks share the scraped one's figures) and the operator's flags.
    pub fn refresh_speeds(&self, now: Instant) {
        self.speeds_stale.store(false, Ordering::Relaxed);
        *self.speeds_refreshed.lock() = Some(now);
        let endpoints = self.endpoints.read().clone();
        let mut replicas: Vec<ReplicaFigures> = Vec::new();
        let mut places: HashMap<&str, usize, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(endpoints.len(), Default::default());
        let mut peer_speeds = self.peer_speeds.lock();
        for endpoint in endpoints.iter() {
            let status = endpoint.status.lock();
            let own = status.speed.measured();
            let peer = if own.is_some() {
                // Measured here now: the peer's figure is not needed again.
                peer_speeds.remove(&endpoint.spec.endpoint);
                None
            } else {
                peer_speeds.get(&endpoint.spec.endpoint).copied()
            };
            let timed = status.speed.timed(now);
            let (speed, borrowed) = match (own, peer, timed) {
                (Some(own), _, _) => (Some(own), None),
                (None, Some(peer), _) => (Some(peer), Some(SpeedSource::Peer)),
                (None, None, Some(timed)) => (Some(timed), Some(SpeedSource::Events)),
                (None, None, None) => (None, None),
            };
            let measurement = Measurement {
                speed,
                samples: status.speed.samples(),
                current: borrowed.is_some() || status.speed.is_current(now),
            };
            let replica = ReplicaFigures {
                measurement,
                borrowed,
                ranks: 1,
            };
            match places
                .get(endpoint.spec.endpoint.as_str())
                .and_then(|&i| replicas.get_mut(i))
            {
                Some(known) => {
                    let ranks = known.ranks + 1;
                    // A rank timed by its events stands for the replica when no rank's
                    // metrics measured it.
                    if replica.measurement.samples > known.measurement.samples
                        || (replica.measurement.samples == known.measurement.samples
                            && known.measurement.speed.is_none()
                            && replica.measurement.speed.is_some())
                    {
                        *known = replica;
                    }
                    known.ranks = ranks;
                }
                None => {
                    places.insert(&endpoint.spec.endpoint, replicas.len());
                    replicas.push(replica);
                }
            }
        }
        drop(peer_speeds);
        let measured: Vec<Measurement> = replicas.iter().map(|r| r.measurement).collect();
        let views = crate::speed::speeds(&measured, self.settings.speed_flags);
        let mut table = self.speeds.write();
        let mut backlogs = self.backlogs.lock();
        // Whether a pick overdue somewhere may cap a speed as its wait goes on.
        let mut cap_may_fall = false;
        for endpoint in endpoints.iter() {
            let Some((mut view, replica)) = places
                .get(endpoint.spec.endpoint.as_str())
                .and_then(|&i| Some((*views.get(i)?, *replicas.get(i)?)))
            else {
                continue;
            };
            let borrowed = replica.borrowed;
            if let Some(source) = borrowed {
                // The figures are a peer's or its events', not its metrics' measurement.
                if view.source == SpeedSource::Measured {
                    view.source = source;
                }
                view.measured_tokens_per_second = None;
                view.measured_overhead_ms = None;
                view.measured_cached_token_cost = None;
                view.measured_context_cost = None;
            }
            // While a pick it was sent is overdue, it is no faster than its events allow,
            // and the bound falls with every refresh until the pick is confirmed.
            if self.may_cap_by_overdue(&replica) {
                if let Some(capped) = backlogs.overdue(endpoint.slot, now).and_then(|overdue| {
                    crate::speed::capped_by_overdue(view.tokens_per_second, overdue)
                }) {
                    view.tokens_per_second = capped;
                    cap_may_fall = true;
                }
            }
            if let Some(entry) = table.get_mut(endpoint.slot.index()) {
                *entry = view;
            }
            backlogs.set_speed(endpoint.slot, view.tokens_per_second, now);
            let label = EndpointLabel {
                endpoint: endpoint.spec.endpoint.clone(),
            };
            self.metrics
                .prefill_tokens_per_second
                .get_or_create(&label)
                .set(view.tokens_per_second);
            self.metrics
                .prefill_overhead_seconds
                .get_or_create(&label)
                .set(view.overhead_ms / 1e3);
            self.metrics
                .prefill_cached_token_cost
                .get_or_create(&label)
                .set(view.cached_token_cost);
            self.metrics
                .prefill_context_cost
                .get_or_create(&label)
                .set(view.context_cost);
        }
        if cap_may_fall {
            // The cap falls as the wait goes on, with no scrape or event to say so: the
            // next tick refreshes again.
            self.speeds_stale.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a pick overdue on `replica` may cap its speed: neither its metrics nor a
    /// peer measured it (its figures are its events' or none), no flag fixes its speed,
    /// and it has one rank (a pick is booked on one rank, and the replica's front end
    /// picks the rank that serves it, so the booked one may never store its blocks).
    fn may_cap_by_overdue(&self, replica: &ReplicaFigures) -> bool {
        (replica.borrowed == Some(SpeedSource::Events) || replica.measurement.speed.is_none())
            && self.settings.speed_flags.tokens_per_second.is_none()
            && replica.ranks == 1
    }

    /// Puts a freed slot back to the speed nothing measured.
    pub fn forget_speed(&self, slot: Slot) {
        let initial = crate::speed::unmeasured(self.settings.speed_flags);
        if let Some(entry) = self.speeds.write().get_mut(slot.index()) {
            *entry = initial;
        }
        self.backlogs
            .lock()
            .set_speed(slot, initial.tokens_per_second, Instant::now());
    }

    /// Ready once every endpoint is synced or flagged incomplete.
    pub fn ready(&self) -> bool {
        self.endpoints.read().iter().all(|e| {
            let status = e.status.lock();
            status.synced || status.incomplete.is_some()
        })
    }

    /// Ranks the endpoints for a request, changing nothing: lookups run side by side
    /// under read locks.
    pub fn rank(&self, request: &LookupRequest, now: Instant) -> Ranking {
        let own = match &request.query {
            Query::Blocks(keys) => keys.as_slice(),
            Query::Text(_) => &[],
        };
        self.rank_sized(request, request.query.len(), None, own, now)
    }

    /// [`rank`](Self::rank) for a request of `request_blocks` blocks, whatever its query
    /// holds (a salt probe has an estimated size, and text keys or none; text matches
    /// count in proportion), ranking `presumed` as if it held all of them (the replica a
    /// salt's first request was booked on, before its events could say so), its backlog
    /// less the picks queued under one of `own` (see [`Backlogs::pending_tokens`]).
    fn rank_sized(
        &self,
        request: &LookupRequest,
        request_blocks: usize,
        presumed: Option<&str>,
        own: &[BlockKey],
        now: Instant,
    ) -> Ranking {
        let endpoints = self.endpoints.read().clone();
        let matches = self.matches(&endpoints, &request.query, now);
        let pending = self.backlogs.lock().pending_tokens(now, own);
        let mut replicas = self.replicas(&endpoints, &matches, &pending, request.model.as_deref());
        // Text keys stand for a request of `request_blocks` blocks: their matches count in
        // proportion.
        if let Query::Text(keys) = &request.query {
            if !keys.is_empty() && keys.len() != request_blocks {
                for replica in &mut replicas {
                    let matched = replica.record.matched_blocks as usize;
                    let blocks = matched.saturating_mul(request_blocks) / keys.len();
                    replica.record.matched_blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
                }
            }
        }
        if let Some(replica) = presumed.and_then(|endpoint| {
            replicas
                .iter_mut()
                .find(|r| name_in(&endpoints, r) == endpoint)
        }) {
            replica.record.matched_blocks = u32::try_from(request_blocks).unwrap_or(u32::MAX);
        }
        let rankable: Vec<usize> = (0..replicas.len())
            .filter(|&i| replicas.get(i).is_some_and(|r| r.serves_model))
            .collect();
        let candidates: Vec<Candidate> = rankable
            .iter()
            .filter_map(|&i| replicas.get(i))
            .map(Replica::candidate)
            .collect();
        let turn = self
            .lookups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Block matches only: text matches are scaled (and salt probes, the only presumed
        // picks, carry text keys).
        let longest = candidates
            .iter()
            .map(|c| c.matched_blocks)
            .max()
            .unwrap_or(0);
        let ended_at = match &request.query {
            Query::Blocks(keys) => longest
                .checked_sub(1)
                .and_then(|last| keys.get(last))
                .filter(|_| longest >= self.settings.policy.min_matched_blocks)
                .map(|key| key.0),
            _ => None,
        };
        let demand = ended_at.map_or(kvaffine_core::Demand::Own, |key| {
            self.recent_prefixes.lock().demand(key, now)
        });

        let (order, reason) = self.settings.policy.rank_top(
            request_blocks,
            &candidates,
            turn,
            demand,
            request.candidates,
        );
        if reason == Reason::Saturated && tracing::enabled!(tracing::Level::DEBUG) {
            let name = |i: usize| {
                rankable
                    .get(i)
                    .and_then(|&r| replicas.get(r))
                    .map_or("", |r| name_in(&endpoints, r))
            };
            let first = order.first().copied();
            let longest = (0..candidates.len())
                .filter(|&i| candidates.get(i).is_some_and(|c| c.usable && !c.gone))
                .max_by_key(|&i| candidates.get(i).map_or(0, |c| c.matched_blocks));
            if let (Some(first), Some(longest)) = (first, longest) {
                let policy = &self.settings.policy;
                let least_waiting = kvaffine_core::PickPolicy::least_waiting(&candidates);
                let figures = |i: usize| {
                    candidates.get(i).map(|c| {
                        (
                            c.matched_blocks,
                            c.load.waiting,
                            c.load.pending_prefill_tokens,
                            (policy.cost(request_blocks, c, demand) * 1e3).round(),
                            policy.saturated(c, least_waiting),
                            c.speed.tokens_per_second.round(),
                            c.speed.overhead_tokens.round(),
                            c.speed.cached_token_cost,
                            c.speed.context_cost,
                        )
                    })
                };
                tracing::debug!(
                    chosen = name(first),
                    longest = name(longest),
                    ?demand,
                    "(matched blocks, waiting, pending prefill tokens, cost ms, saturated, \
                     tokens per second, overhead tokens, cached token cost, context cost): \
                     chosen {:?}, longest match {:?}",
                    figures(first),
                    figures(longest),
                );
            }
        }
        let tokenize_at = self
            .settings
            .policy
            .least_busy(&candidates, turn)
            .and_then(|i| replicas.get(*rankable.get(i)?))
            .map(|r| name_in(&endpoints, r).to_owned());
        Ranking {
            endpoints,
            tokenize_at,
            complete: replicas.iter().all(|r| r.record.complete),
            order: order
                .into_iter()
                .filter_map(|i| rankable.get(i).copied())
                .collect(),
            replicas,
            reason,
            ended_at,
            demand,
        }
    }

    /// How far every slot holds the query's keys: block keys in the KV-event index (and,
    /// for the GPU tier, with bookings over it), text keys in the approximate history.
    fn matches(&self, endpoints: &[Arc<Endpoint>], query: &Query, now: Instant) -> Matches {
        match query {
            Query::Text(keys) => {
                let routed = self.history.read().longest_prefixes(keys);
                Matches {
                    matched: routed.clone(),
                    indexed: routed,
                    tiers: Vec::new(),
                    windows: Vec::new(),
                }
            }
            Query::Blocks(keys) => {
                if self.bookings.read().has_expired(now) {
                    self.bookings.write().expire(now);
                }
                let keys: Vec<u64> = keys.iter().map(|k| k.0).collect();
                // Replicas whose groups are not one full-attention group 0.
                let special: Vec<(Slot, Arc<Rule>)> = endpoints
                    .iter()
                    .filter_map(|e| {
                        let status = e.status.lock();
                        (!status.rule.is_plain()).then(|| (e.slot, status.rule.clone()))
                    })
                    .collect();
                let index = self.index.read();
                let bookings = self.bookings.read();
                let mut gpu = Walks::new(&keys, &index, &bookings, GPU);
                let mut matched = gpu.depths(0, true);
                let mut indexed = gpu.depths(0, false);
                let mut windows = vec![
                    None;
                    special
                        .iter()
                        .map(|(s, _)| s.index() + 1)
                        .max()
                        .unwrap_or(0)
                ];
                for (slot, rule) in &special {
                    let n = slot.index();
                    let (i, m) = match &**rule {
                        Rule::Unsupported(_) => (0, 0),
                        Rule::Prefix(full) => (gpu.depth(full, n, false), gpu.depth(full, n, true)),
                        Rule::Hybrid {
                            full,
                            windows: groups,
                        } => {
                            let full_matched = gpu.depth(full, n, true);
                            if let Some(w) = windows.get_mut(n) {
                                *w = Some(Windows {
                                    full: full_matched,
                                    needed: groups.iter().map(|(_, k)| *k).max().unwrap_or(0),
                                });
                            }
                            let indexed = hybrid_hit(
                                gpu.depth(full, n, false),
                                groups,
                                gpu.held(*slot, false),
                            );
                            let matched = if bookings.is_empty() {
                                indexed
                            } else {
                                hybrid_hit(full_matched, groups, gpu.held(*slot, true))
                            };
                            (indexed, matched)
                        }
                    };
                    indexed.set(n, i);
                    matched.set(n, m);
                }
                let tiers = index
                    .media()
                    .filter(|m| *m != GPU)
                    .map(|medium| {
                        let mut tier = Walks::new(&keys, &index, &bookings, medium);
                        let mut depths = tier.depths(0, false);
                        for (slot, rule) in &special {
                            let n = slot.index();
                            let depth = match &**rule {
                                Rule::Prefix(full) | Rule::Hybrid { full, .. } => {
                                    tier.depth(full, n, false)
                                }
                                Rule::Unsupported(_) => 0,
                            };
                            depths.set(n, depth);
                        }
                        (medium.to_owned(), depths)
                    })
                    .collect();
                Matches {
                    matched,
                    indexed,
                    tiers,
                    windows,
                }
            }
        }
    }

    /// One [`Replica`] per followed replica: its data-parallel ranks' streams merge into
    /// one record.
    /// One [`Replica`] per replica of `endpoints`, `serves_model` set by whether it
    /// serves `model`.
    fn replicas(
        &self,
        endpoints: &[Arc<Endpoint>],
        matches: &Matches,
        pending: &[u64],
        model: Option<&str>,
    ) -> Vec<Replica> {
        let speeds = self.speeds.read();
        let mut replicas: Vec<Replica> = Vec::with_capacity(endpoints.len());
        // Replica -> its place in `replicas`: a large fleet's ranks merge without a scan.
        // Streams are unique by (replica, rank), so with no rank but 0 there is nothing to
        // merge and no name to hash.
        let merging = endpoints.iter().any(|e| e.spec.rank != 0);
        let mut places: HashMap<&str, usize, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(
                if merging { endpoints.len() } else { 0 },
                Default::default(),
            );
        for (position, endpoint) in endpoints.iter().enumerate() {
            let slot = endpoint.slot.index();
            let status = endpoint.status.lock();
            let at = |a: &Depths| a.get(slot);
            let load = status.load.unwrap_or_default();
            let stream = Found {
                matched_blocks: at(&matches.matched),
                indexed_blocks: at(&matches.indexed),
                tiers: if matches.tiers.is_empty() {
                    BTreeMap::new()
                } else {
                    matches
                        .tiers
                        .iter()
                        .filter(|(_, m)| at(m) > 0)
                        .map(|(name, m)| (name.clone(), at(m)))
                        .collect()
                },
                running: load.running,
                waiting: load.waiting,
                kv_cache_usage: load.kv_cache_usage,
                pending_prefill_tokens: pending.get(slot).copied().unwrap_or(0),
                complete: status.incomplete.is_none(),
                synced: status.synced,
                configured: status.misconfigured.is_none(),
                reachable: status.scrape_error.is_none(),
                connected: !status.events_disconnected,
                alignment: status.alignment,
            };
            let merged_into = if merging {
                places
                    .get(endpoint.spec.endpoint.as_str())
                    .and_then(|&i| replicas.get_mut(i))
            } else {
                None
            };
            match merged_into {
                None => {
                    if merging {
                        places.insert(&endpoint.spec.endpoint, replicas.len());
                    }
                    replicas.push(Replica {
                        at: position,
                        record: stream,
                        best_slot: endpoint.slot,
                        best_rank: endpoint.spec.rank,
                        windows: matches.windows.get(slot).copied().flatten(),
                        serves_model: match (model, status.model.as_deref()) {
                            (Some(wanted), Some(served)) => wanted == served,
                            _ => true,
                        },
                        speed: speeds.get(slot).copied().unwrap_or_default().speed(),
                    });
                }
                Some(replica) => {
                    if stream.matched_blocks > replica.record.matched_blocks {
                        replica.best_slot = endpoint.slot;
                        replica.best_rank = endpoint.spec.rank;
                        replica.windows = matches.windows.get(slot).copied().flatten();
                    }
                    replica.record.merge_rank(stream);
                }
            }
        }
        replicas
    }

    /// Books the ranking's pick, if the request asks for it: its prefill joins the
    /// replica's backlog, and its keys count as held there (block keys until its events
    /// confirm them; text keys in the approximate history), here and at every peer.
    /// Returns the endpoint booked.
    pub fn book(&self, request: &LookupRequest, ranking: &Ranking, now: Instant) -> Option<String> {
        let booking = request.book?;
        let replica = ranking.replicas.get(*ranking.order.first()?)?;
        let (record, slot) = (&replica.record, replica.best_slot);
        let endpoint = ranking.name(replica);
        let work = self.settings.policy.prefill_work(
            request.query.len(),
            record.matched_blocks as usize,
            &replica.speed,
        ) + replica.speed.overhead_tokens;
        let ttl = booking
            .ttl_ms
            .map_or(self.settings.booking_ttl, std::time::Duration::from_millis);
        let held = match &request.query {
            Query::Blocks(keys) => {
                self.metrics
                    .booked_predicted
                    .get_or_create(&EndpointLabel {
                        endpoint: endpoint.to_owned(),
                    })
                    // What it can serve: its events' confirmed prefix, bookings left out
                    // (the prediction the filter reports too).
                    .inc_by(
                        u64::from(record.indexed_blocks) * self.settings.keys.block_size() as u64,
                    );
                // On a hybrid replica the request leaves the window before its end cached
                // in the window groups, and the one before the point where its full-attention
                // hit ended when that was not served (vLLM keeps that junction for the
                // siblings to come).
                let windows: Vec<(usize, usize)> = replica
                    .windows
                    .map(|w| {
                        let end = keys.len();
                        let junction = w.full as usize;
                        let mut ranges = Vec::with_capacity(2);
                        ranges.push((end.saturating_sub(w.needed), end));
                        if (record.matched_blocks as usize) < junction && junction < end {
                            ranges.push((junction.saturating_sub(w.needed), junction));
                        }
                        ranges
                    })
                    .unwrap_or_default();
                Held::Blocks {
                    keys: keys.iter().map(|k| k.0).collect(),
                    windows,
                }
            }
            Query::Text(keys) => Held::Text {
                keys: keys.iter().map(|k| k.0).collect(),
            },
        };
        self.hold(slot, endpoint, work as u64, &held, now, now + ttl);
        self.share(endpoint, replica.best_rank, work as u64, ttl, held, now);
        Some(endpoint.to_owned())
    }

    /// Holds a booking on `slot` (of replica `endpoint`) until `expires`: its `work`
    /// joins the replica's backlog, and what it holds counts as held there.
    fn hold(
        &self,
        slot: Slot,
        endpoint: &str,
        work: u64,
        held: &Held,
        now: Instant,
        expires: Instant,
    ) {
        match held {
            Held::Blocks { keys, windows } => {
                // A booking restored from a peer carries no work. A last block the replica
                // holds already is not stored again (vLLM stores a block once): its pick
                // may never be confirmed, and times nothing.
                if work > 0 {
                    let confirmed_by = match keys.last() {
                        None => ConfirmedBy::Nothing,
                        Some(&last) if self.index.read().holds_in_any_group(GPU, last, slot) => {
                            ConfirmedBy::Key(last)
                        }
                        Some(&last) => ConfirmedBy::LastBlock(last),
                    };
                    self.backlogs.lock().add(slot, work, confirmed_by, now);
                    // Awaited from now: the speed of a replica nothing measured is capped
                    // while the pick is overdue, from the next refresh on. A cheap superset
                    // of `may_cap_by_overdue` (which the refresh applies): it spares a
                    // measured fleet, nearly every booking's case, a refresh every tick.
                    let awaited_unmeasured = matches!(confirmed_by, ConfirmedBy::LastBlock(_))
                        && self.settings.speed_flags.tokens_per_second.is_none()
                        && self
                            .speeds
                            .read()
                            .get(slot.index())
                            .is_some_and(|view| view.measured_tokens_per_second.is_none());
                    if awaited_unmeasured {
                        self.speeds_stale.store(true, Ordering::Relaxed);
                    }
                }
                let keys: Vec<BlockKey> = keys.iter().copied().map(BlockKey).collect();
                let windows: Vec<std::ops::Range<usize>> =
                    windows.iter().map(|&(start, end)| start..end).collect();
                if !self.bookings.write().book(slot, &keys, &windows, expires) {
                    self.metrics.bookings_refused.inc();
                }
            }
            Held::Text { keys } => {
                if work > 0 {
                    self.backlogs
                        .lock()
                        .add(slot, work, ConfirmedBy::Nothing, now);
                }
                let keys: Vec<TextKey> = keys.iter().copied().map(TextKey).collect();
                self.history.write().record(slot, &keys);
            }
            Held::Salt { salt } => {
                // Queued under the salt's tag: its events' first block of the salt
                // confirms it. A booking restored from a peer carries no work.
                if work > 0 {
                    self.backlogs
                        .lock()
                        .add(slot, work, ConfirmedBy::Key(*salt), now);
                }
                if !self
                    .salt_bookings
                    .lock()
                    .book(*salt, endpoint, now, expires)
                {
                    self.metrics.bookings_refused.inc();
                }
            }
        }
    }

    /// Queues a booking held here for the peers, if there are any.
    fn share(
        &self,
        endpoint: &str,
        rank: u32,
        work: u64,
        ttl: std::time::Duration,
        held: Held,
        now: Instant,
    ) {
        let Some(peers) = self.peers.get() else {
            return;
        };
        let booking = Arc::new(PeerBooking {
            endpoint: endpoint.to_owned(),
            rank,
            work,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            held,
        });
        self.ledger.lock().remember(booking.clone(), now + ttl, now);
        if peers.queue.try_send(booking).is_err() {
            self.metrics.count_peer_bookings("dropped", 1);
        }
    }

    /// Holds bookings a peer made, as if made here (they are not sent on), counted under
    /// `outcome` (`received` as they are made, `restored` when taken at start). A booking
    /// of a stream this daemon does not follow is counted and skipped; one held longer
    /// than ten of this daemon's booking TTLs is held that long. Returns how many it holds.
    pub fn hold_peer_bookings(
        &self,
        bookings: &[PeerBooking],
        now: Instant,
        outcome: &'static str,
    ) -> usize {
        let mut held = 0;
        let slots: HashMap<(String, u32), Slot> = self
            .endpoints
            .read()
            .iter()
            .map(|e| ((e.spec.endpoint.clone(), e.spec.rank), e.slot))
            .collect();
        let longest = self.settings.booking_ttl * 10;
        for booking in bookings {
            let Some(&slot) = slots.get(&(booking.endpoint.clone(), booking.rank)) else {
                self.metrics.count_peer_bookings("unknown_stream", 1);
                continue;
            };
            // Its replica's events may have come first: the pick is done, and holding it
            // would count its prefill as queued until it drained at the replica's speed.
            let stored = match &booking.held {
                Held::Blocks { keys, .. } => keys
                    .last()
                    .is_some_and(|k| self.index.read().holds_in_any_group(GPU, *k, slot)),
                Held::Salt { .. } | Held::Text { .. } => false,
            };
            if stored {
                self.metrics.count_peer_bookings("already_stored", 1);
                continue;
            }
            let ttl = std::time::Duration::from_millis(booking.ttl_ms).min(longest);
            self.hold(
                slot,
                &booking.endpoint,
                booking.work,
                &booking.held,
                now,
                now + ttl,
            );
            if self.peers.get().is_some() {
                self.ledger
                    .lock()
                    .remember(Arc::new(booking.clone()), now + ttl, now);
            }
            self.metrics.count_peer_bookings(outcome, 1);
            held += 1;
        }
        held
    }

    /// Ranks, then books if asked, counting the outcome.
    pub fn lookup(&self, request: &LookupRequest, now: Instant) -> (Ranking, Option<String>) {
        let ranking = self.rank(request, now);
        // Only picks count: an operator's explain or a probe asks without booking.
        if let Some(key) = ranking.ended_at.filter(|_| request.book.is_some()) {
            self.recent_prefixes.lock().note(key, now);
        }
        if ranking.demand == kvaffine_core::Demand::Shared {
            self.metrics.shared_prefix_lookups.inc();
        }
        let booked = self.book(request, &ranking, now);
        self.metrics.count_lookup(ranking.reason);
        (ranking, booked)
    }

    /// Answers a salt probe. While a replica of the model holds, or may hold, a first
    /// block of the salt, nothing is routed: the filter tokenizes and looks up. Otherwise
    /// no cached prefix can match, and the request is routed and booked for the salt.
    /// With the probe's text keys, while the salt is booked (its picks made, their events
    /// not in yet), it is ranked as far as its text and template agree with where the
    /// salt's earlier picks went, in estimated blocks, the salt's own queued picks not
    /// counting against it: a sibling sharing the first request's document and template
    /// follows it (`salt-booked`) unless that replica's queue costs more than a cold
    /// prefill elsewhere (`saturated`); one that renders differently goes by load
    /// (`new-salt`), as its tokens would have sent it. Without text keys (filters before
    /// them), a salt booked on a replica is ranked as if that replica held the whole
    /// request, the salt's own queued picks not counting against it.
    pub fn probe(&self, probe: &SaltProbe, now: Instant) -> SaltAnswer {
        let by_text = probe.text.is_some();
        let held = self.salt_may_be_held(probe.salt, probe.model.as_deref());
        // Text keys are followed only while the salt is booked: like a booking, where its
        // requests went stops counting when no event has confirmed it in time (a failed
        // request, an evicted salt).
        let followed = by_text && !held && self.salt_bookings.lock().get(probe.salt, now).is_some();
        let text = match &probe.text {
            Some(keys) if followed => keys.clone(),
            _ => Vec::new(),
        };
        let request = LookupRequest {
            query: Query::Text(text),
            model: probe.model.clone(),
            book: probe.book,
            candidates: probe.candidates.max(1),
        };
        // Without text, where the salt was booked stands for what it holds, and its own
        // picks, queued under its tag, do not count: a continuation of them would wait
        // for them wherever it went.
        let booked = if held || by_text {
            None
        } else {
            self.salt_bookings.lock().get(probe.salt, now)
        };
        let request_blocks = self.probe_blocks(probe);
        // A request that extends where the salt went (its continuation, before the events)
        // needs the salt's queued prefill wherever it goes: those picks do not push it off
        // the replica it follows. One that matches nothing still counts them, so a burst
        // of the tenant's other templates spreads.
        let follows = match &request.query {
            Query::Text(keys) if !keys.is_empty() => {
                let depths = self.history.read().longest_prefixes(keys);
                self.endpoints.read().iter().any(|e| {
                    // In estimated blocks, as the ranking counts them.
                    (depths.get(e.slot.index()) as usize).saturating_mul(request_blocks)
                        / keys.len()
                        > 0
                })
            }
            _ => false,
        };
        let own = if by_text && !follows {
            Vec::new()
        } else {
            vec![BlockKey(probe.salt)]
        };
        let mut ranking = self.rank_sized(&request, request_blocks, booked.as_deref(), &own, now);
        if held {
            self.metrics.salt_probes_held.inc();
            return SaltAnswer {
                route: None,
                tokenize_at: ranking.tokenize_at,
            };
        }
        let first = ranking.order.first().and_then(|&i| ranking.replicas.get(i));
        ranking.reason = match first {
            Some(_) if by_text && ranking.reason == Reason::Prefix => Reason::SaltBooked,
            Some(first) if booked.as_deref() == Some(ranking.name(first)) => Reason::SaltBooked,
            Some(_) if ranking.reason == Reason::Saturated => Reason::Saturated,
            Some(_) => Reason::NewSalt,
            None => ranking.reason,
        };
        // What the replicas' events hold of a salt none holds: nothing. The text matches
        // were estimates for the ranking.
        for replica in &mut ranking.replicas {
            replica.record.indexed_blocks = 0;
        }
        let booked = self.book_salt(probe, &ranking, now);
        self.metrics.count_lookup(ranking.reason);
        SaltAnswer {
            route: Some(ranking.answer(request.candidates, booked)),
            tokenize_at: None,
        }
    }

    /// Whether a replica that serves `model` (or may) holds a first block of salt `tag`,
    /// or its index cannot tell: not complete (no replay socket, or a gap), or not caught
    /// up with its stream. Replicas that cannot be picked (unreachable, stream gone) do
    /// not count.
    fn salt_may_be_held(&self, tag: u64, model: Option<&str>) -> bool {
        let index = self.index.read();
        self.endpoints.read().iter().any(|endpoint| {
            let status = endpoint.status.lock();
            let serves = match (model, status.model.as_deref()) {
                (Some(wanted), Some(served)) => wanted == served,
                _ => true,
            };
            let pickable = status.scrape_error.is_none() && !status.events_disconnected;
            serves
                && pickable
                && (index.salts.may_hold(tag, endpoint.slot)
                    || status.incomplete.is_some()
                    || !status.synced)
        })
    }

    /// Blocks in a probe's prompt, by the filter's estimate of its tokens.
    fn probe_blocks(&self, probe: &SaltProbe) -> usize {
        let tokens = usize::try_from(probe.tokens.unwrap_or(0)).unwrap_or(usize::MAX);
        tokens / self.settings.keys.block_size().max(1)
    }

    /// Books a probe's pick for its salt, if asked: its prefill (all of its estimated
    /// blocks: nothing of a new salt is cached) and the replica's fixed cost join the
    /// replica's backlog under the salt's tag (its events' first block of the salt
    /// confirms it), and its text keys, if the probe has them, are held there too: the
    /// salt's next requests follow it (as far as their texts agree, given text keys) until
    /// its events show the salt or the booking expires.
    fn book_salt(&self, probe: &SaltProbe, ranking: &Ranking, now: Instant) -> Option<String> {
        let booking = probe.book?;
        let replica = ranking.replicas.get(*ranking.order.first()?)?;
        // A pick that followed the salt's text queues what its match leaves uncached, as a
        // lookup's pick does; without text, all of it (the whole-request presumption says
        // nothing of what is cached).
        let matched = if probe.text.is_some() {
            replica.record.matched_blocks as usize
        } else {
            0
        };
        let work =
            self.settings
                .policy
                .prefill_work(self.probe_blocks(probe), matched, &replica.speed)
                + replica.speed.overhead_tokens;
        let ttl = booking
            .ttl_ms
            .map_or(self.settings.booking_ttl, std::time::Duration::from_millis);
        let held = Held::Salt { salt: probe.salt };
        let endpoint = ranking.name(replica);
        self.hold(
            replica.best_slot,
            endpoint,
            work as u64,
            &held,
            now,
            now + ttl,
        );
        self.share(endpoint, replica.best_rank, work as u64, ttl, held, now);
        if let Some(keys) = &probe.text {
            if !keys.is_empty() {
                // Its text keys, held where it went (no work of their own: the salt's
                // booking queues the prefill), so the salt's next requests can follow it
                // as far as they agree.
                let held = Held::Text {
                    keys: keys.iter().map(|k| k.0).collect(),
                };
                self.hold(replica.best_slot, endpoint, 0, &held, now, now + ttl);
                self.share(endpoint, replica.best_rank, 0, ttl, held, now);
            }
        }
        Some(endpoint.to_owned())
    }
}

/// One lookup's walks over one tier's groups, each group walked once however many
/// replicas read it.
struct Walks<'a> {
    keys: &'a [u64],
    index: &'a PrefixIndex,
    bookings: &'a Bookings,
    medium: &'a str,
    /// (group, with bookings) -> leading blocks per slot.
    done: Vec<((Group, bool), Depths)>,
}

impl<'a> Walks<'a> {
    fn new(
        keys: &'a [u64],
        index: &'a PrefixIndex,
        bookings: &'a Bookings,
        medium: &'a str,
    ) -> Self {
        Self {
            keys,
            index,
            bookings,
            medium,
            done: Vec::new(),
        }
    }

    /// Every slot's leading blocks in `group`, bookings counted if `booked` (GPU only).
    fn depths(&mut self, group: Group, booked: bool) -> Depths {
        let walk = self.walk(group, booked);
        self.done
            .get(walk)
            .map(|(_, depths)| depths.clone())
            .unwrap_or_default()
    }

    /// Walks `group` unless done already; returns the walk's place in `done`.
    fn walk(&mut self, group: Group, booked: bool) -> usize {
        let booked = booked && self.medium == GPU && !self.bookings.is_empty();
        if let Some(i) = self.done.iter().position(|(k, _)| *k == (group, booked)) {
            return i;
        }
        let tier = self.index.tier(self.medium, group);
        let keys = self.keys.iter().copied();
        let depths = if booked {
            longest_prefixes_by(keys, |k| (tier(k), self.bookings.holders(k)))
        } else {
            longest_prefixes_by(keys, tier)
        };
        self.done.push(((group, booked), depths));
        self.done.len() - 1
    }

    /// Slot `n`'s leading blocks held by every one of the `full` groups.
    fn depth(&mut self, full: &[Group], n: usize, booked: bool) -> u32 {
        full.iter()
            .map(|&g| {
                let walk = self.walk(g, booked);
                self.done.get(walk).map_or(0, |(_, depths)| depths.get(n))
            })
            .min()
            .unwrap_or(0)
    }

    /// Whether `slot` holds block `b` in window group `g` (its bookings' windows counted
    /// if `booked`).
    fn held(&self, slot: Slot, booked: bool) -> impl Fn(Group, usize) -> bool + '_ {
        move |group, block| {
            self.keys.get(block).is_some_and(|&k| {
                self.index.holds(self.medium, group, k, slot)
                    || (booked && self.bookings.window_holds(k, slot))
            })
        }
    }
}
