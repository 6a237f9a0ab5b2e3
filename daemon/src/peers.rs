//! Bookings shared between daemons. Several gateways, each with a kvaffined beside it,
//! route to the same replicas: every daemon follows every replica's events, so their
//! indexes agree, but a pick is booked only in the daemon that made it. Siblings of a
//! fresh prefix that reach another gateway before the replica's events would then scatter,
//! and each daemon would count only its own gateway's queued prefill. With `--peer`, each
//! booking is also sent to the other daemons, which hold it as their own (without sending
//! it on): over the index API, with the daemon's own API token. A daemon that starts
//! takes the bookings its peers hold ([`restore`]), so a restart does not forget the
//! picks whose events are still on their way.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvaffine_core::PrefillSpeed;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::state::Daemon;

/// Where a daemon takes its peers' bookings.
pub const PEER_BOOKINGS_PATH: &str = "/v2/peer/bookings";

/// The header a daemon names itself with on what it asks its peers, and on its answer
/// when a request names itself: a daemon among its own peers (a DNS name of every gateway
/// pod, its own included; an address it is reached at but does not listen on by that name)
/// finds itself by it and leaves itself out.
pub const INSTANCE_HEADER: &str = "x-kvaffined-instance";

/// Bookings waiting to be sent; past it new ones are dropped and counted (a peer that
/// cannot keep up loses affinity, never the lookups' time).
const QUEUE: usize = 10_000;

/// Most bookings in one batch (their keys are bounded by `--max-keys` too), so a batch
/// stays within the body bound every daemon of the fleet shares.
const BATCH: usize = 256;

/// Most bookings a daemon keeps for a peer that starts (the newest live ones): bookings
/// live for a TTL of seconds, so this covers hundreds of picks a second.
const LEDGER_BOOKINGS: usize = 4_096;

/// Most keys those bookings hold in all (about 8 MiB of keys, 20 MB of JSON for the peer).
const LEDGER_KEYS: usize = 1 << 20;

/// Longest a starting daemon waits for its peers' bookings, its lookups waiting with it (a
/// lookup answered before would miss them): below the filter's default `timeout_ms` (300),
/// so a lookup that waited is still answered in time. Bookings that arrive later are not
/// taken: by then this daemon has booked picks of its own, which its peers would hand back.
pub const RESTORE_GATE: Duration = Duration::from_millis(250);

/// How long a starting daemon waits for a peer's measured speeds.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a peer has to take a batch.
const SEND_TIMEOUT: Duration = Duration::from_millis(500);

/// A peer that keeps failing is warned about at most this often.
const WARNING_EVERY: Duration = Duration::from_secs(10);

/// A pick's booking as it is applied: here, and by every peer that follows the stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerBooking {
    /// The replica booked (its `HOST:PORT`).
    pub endpoint: String,
    /// Its data-parallel rank whose stream holds the booking.
    pub rank: u32,
    /// Prefill work the pick queued on it, in computed-token equivalents.
    pub work: u64,
    /// How much longer the booking holds.
    pub ttl_ms: u64,
    /// What it holds.
    pub held: Held,
}

/// What a booking counts as held until it expires or the replica's events confirm it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Held {
    /// The request's block keys, and the ranges of them its hybrid replica keeps in its
    /// sliding windows.
    Blocks {
        /// Block keys, first block first.
        keys: Vec<u64>,
        /// `[start, end)` ranges of `keys`.
        windows: Vec<(usize, usize)>,
    },
    /// A salted request routed without its keys (a salt probe's pick).
    Salt {
        /// The salt's tag.
        salt: u64,
    },
    /// The request's text keys (approximate mode).
    Text {
        /// Text-prefix keys.
        keys: Vec<u64>,
    },
}

impl Held {
    fn keys(&self) -> usize {
        match self {
            Self::Blocks { keys, .. } | Self::Text { keys } => keys.len(),
            Self::Salt { .. } => 1,
        }
    }
}

/// A batch of bookings, as sent to a peer.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeerBookings {
    /// The bookings, oldest first.
    pub bookings: Vec<PeerBooking>,
}

/// The live bookings a daemon holds (its own and its peers'), kept for a peer that starts:
/// its own copies expire with it. Shared, so a peer's copy is taken without holding the
/// lock that every booked lookup takes.
#[derive(Debug, Default)]
pub struct Ledger {
    bookings: VecDeque<(Instant, Arc<PeerBooking>)>,
    keys: usize,
}

impl Ledger {
    /// Keeps `booking` until `expires`. Past [`LEDGER_BOOKINGS`] bookings or
    /// [`LEDGER_KEYS`] keys, the expired go, then the oldest.
    pub fn remember(&mut self, booking: Arc<PeerBooking>, expires: Instant, now: Instant) {
        let full = |ledger: &Self| {
            ledger.bookings.len() >= LEDGER_BOOKINGS
                || ledger.keys + booking.held.keys() > LEDGER_KEYS
        };
        if full(self) {
            self.bookings.retain(|(until, _)| *until > now);
            self.keys = self.bookings.iter().map(|(_, b)| b.held.keys()).sum();
        }
        while full(self) {
            let Some((_, oldest)) = self.bookings.pop_front() else {
                break;
            };
            self.keys -= oldest.held.keys();
        }
        self.keys += booking.held.keys();
        self.bookings.push_back((expires, booking));
    }

    /// The bookings still live at `now` and when each expires.
    pub fn live(&self, now: Instant) -> Vec<(Instant, Arc<PeerBooking>)> {
        self.bookings
            .iter()
            .filter(|(until, _)| *until > now)
            .cloned()
            .collect()
    }
}

/// What a peer that starts is given of `live` bookings at `now`: each for what is left of
/// its TTL, with what it holds but no work (its prefill has partly drained by now, and a
/// starting daemon learns the replicas' queues from their metrics).
pub fn handed_on(live: &[(Instant, Arc<PeerBooking>)], now: Instant) -> PeerBookings {
    let bookings = live
        .iter()
        .map(|(until, booking)| PeerBooking {
            work: 0,
            ttl_ms: u64::try_from(until.saturating_duration_since(now).as_millis())
                .unwrap_or(u64::MAX),
            ..PeerBooking::clone(booking)
        })
        .collect();
    PeerBookings { bookings }
}

/// Takes the live bookings and the replicas' measured speeds its `peers` hold (not
/// `own`, this daemon's address): a daemon that starts beside running peers then knows the
/// picks made before it started (its own included, if it restarted: the peers hold those)
/// and ranks each replica at the speed a peer measured until it has measured the replica
/// itself. Bookings are asked of every peer at once and taken from the first that answers
/// with any within [`RESTORE_GATE`], while lookups wait (those the replicas' replays then
/// confirm are confirmed as any booking is); then lookups go on. Speeds come from each peer
/// in turn until every replica followed has one. A peer that does not answer, or answers
/// 405 (the release before had no `GET` here), is passed over; one that is this daemon
/// itself is left out of `peers`.
pub async fn restore(
    daemon: Arc<Daemon>,
    peers: Arc<PeerList>,
    own: String,
    token: Option<String>,
    client: reqwest::Client,
) {
    let get = |peer: &str, path: &str| {
        let mut request = client
            .get(format!("http://{peer}{path}"))
            .header(INSTANCE_HEADER, daemon.instance.as_str())
            .timeout(RESTORE_TIMEOUT);
        if let Some(token) = &token {
            request = request.bearer_auth(token);
        }
        request
    };
    let instance = daemon.instance.as_str();
    let mut asks = tokio::task::JoinSet::new();
    for peer in peers.current().into_iter().filter(|p| *p != own) {
        let ask = get(&peer, PEER_BOOKINGS_PATH);
        let instance = daemon.instance.clone();
        asks.spawn(async move { (fetch::<PeerBookings>(ask, &instance).await, peer) });
    }
    let gate = tokio::time::sleep(RESTORE_GATE);
    tokio::pin!(gate);
    loop {
        let answer = tokio::select! {
            answer = asks.join_next() => answer,
            () = &mut gate => {
                warn!("no peer handed its bookings on within {RESTORE_GATE:?}: starting without");
                break;
            }
        };
        let Some(Ok((answer, peer))) = answer else {
            break;
        };
        match answer {
            Ok(None) => peers.itself(&peer),
            Ok(Some(batch)) if !batch.bookings.is_empty() => {
                let held = daemon.hold_peer_bookings(&batch.bookings, Instant::now(), "restored");
                info!(%peer, offered = batch.bookings.len(), held, "took the bookings a peer holds");
                break;
            }
            Ok(Some(_)) => {}
            Err(err) => warn!(%peer, "no bookings from this peer at start: {err}"),
        }
    }
    asks.abort_all();
    daemon.restoring.send_replace(false);
    let missing = || {
        let known = daemon.peer_speeds.lock();
        daemon
            .endpoints
            .read()
            .iter()
            .any(|e| !known.contains_key(&e.spec.endpoint))
    };
    let candidates: Vec<String> = peers.current().into_iter().filter(|p| *p != own).collect();
    for peer in &candidates {
        if !missing() {
            return;
        }
        match fetch::<serde_json::Value>(get(peer, "/v1/endpoints"), instance).await {
            Ok(None) => peers.itself(peer),
            Ok(Some(endpoints)) => {
                let speeds = measured_speeds(&endpoints);
                let mut known = daemon.peer_speeds.lock();
                let before = known.len();
                for (endpoint, speed) in speeds {
                    known.entry(endpoint).or_insert(speed);
                }
                let taken = known.len() - before;
                drop(known);
                if taken > 0 {
                    info!(%peer, replicas = taken, "took the prefill speeds a peer measured");
                    daemon.refresh_speeds(Instant::now());
                }
            }
            Err(err) => warn!(%peer, "no prefill speeds from this peer at start: {err}"),
        }
    }
}

/// A peer's answer to `request`, or `None` when the peer is `instance`, the asker itself.
async fn fetch<T: serde::de::DeserializeOwned>(
    request: reqwest::RequestBuilder,
    instance: &str,
) -> reqwest::Result<Option<T>> {
    let response = request.send().await?;
    if is_itself(&response, instance) {
        return Ok(None);
    }
    response.error_for_status()?.json().await.map(Some)
}

/// Each replica's speed as a peer's `/v1/endpoints` shows it measured by the peer itself
/// (`prefill.measured_tokens_per_second` and `measured_overhead_ms`, and the costs of
/// cached tokens and context where the peer shows them: a peer a release older does
/// not, and its replicas take the default's), by `HOST:PORT`.
fn measured_speeds(endpoints: &serde_json::Value) -> Vec<(String, PrefillSpeed)> {
    let Some(all) = endpoints["endpoints"].as_array() else {
        return Vec::new();
    };
    let mut speeds: Vec<(String, PrefillSpeed)> = Vec::new();
    for entry in all {
        let prefill = &entry["prefill"];
        let (Some(endpoint), Some(rate), Some(overhead_ms)) = (
            entry["endpoint"].as_str(),
            prefill["measured_tokens_per_second"].as_f64(),
            prefill["measured_overhead_ms"].as_f64(),
        ) else {
            continue;
        };
        if !(rate.is_finite() && rate > 0.0 && overhead_ms.is_finite() && overhead_ms >= 0.0) {
            continue;
        }
        let cost = |field: &str, default: f64| {
            prefill[field]
                .as_f64()
                .filter(|cost| cost.is_finite() && *cost >= 0.0)
                .unwrap_or(default)
        };
        let default = PrefillSpeed::DEFAULT;
        // A replica's data-parallel ranks share its figures: the first one shown.
        if speeds.iter().all(|(known, _)| known != endpoint) {
            speeds.push((
                endpoint.to_owned(),
                PrefillSpeed {
                    tokens_per_second: rate,
                    overhead_tokens: overhead_ms / 1e3 * rate,
                    cached_token_cost: cost(
                        "measured_cached_token_cost",
                        default.cached_token_cost,
                    ),
                    context_cost: cost("measured_context_cost", default.context_cost),
                },
            ));
        }
    }
    speeds
}

/// The daemons bookings go to (`HOST:PORT` of their API): the `--peer` flags, the
/// config file's `peers` and the addresses of the `--peer-dns` names, which change when
/// the file or the names' answers do (gateway pods come and go), less the addresses found
/// to be this daemon itself.
#[derive(Debug, Default)]
pub struct PeerList {
    flags: Vec<String>,
    file: parking_lot::RwLock<Vec<String>>,
    dns: parking_lot::RwLock<Vec<String>>,
    itself: parking_lot::RwLock<std::collections::HashSet<String>>,
}

impl PeerList {
    /// The `--peer` flags' peers, and none from a file or DNS yet.
    pub fn new(flags: Vec<String>) -> Self {
        Self {
            flags,
            ..Self::default()
        }
    }

    /// The config file now names `peers`.
    pub fn set_file(&self, peers: Vec<String>) {
        *self.file.write() = peers;
    }

    /// The `--peer-dns` names now resolve to `peers`.
    pub fn set_dns(&self, peers: Vec<String>) {
        *self.dns.write() = peers;
    }

    /// `peer` answered as this daemon: it is left out from now on (a pod keeps its
    /// address for its life).
    pub fn itself(&self, peer: &str) {
        if self.itself.write().insert(peer.to_owned()) {
            info!(%peer, "this address is this daemon itself: not a peer");
        }
    }

    /// Whether it names no peer now. Asked on every booked lookup, so it allocates
    /// nothing.
    pub fn is_empty(&self) -> bool {
        let itself = self.itself.read();
        let (file, dns) = (self.file.read(), self.dns.read());
        !self
            .flags
            .iter()
            .chain(file.iter())
            .chain(dns.iter())
            .any(|peer| !itself.contains(peer))
    }

    /// Every peer, each once.
    pub fn current(&self) -> Vec<String> {
        let itself = self.itself.read();
        let mut all: Vec<String> = Vec::new();
        for peer in self
            .flags
            .iter()
            .chain(self.file.read().iter())
            .chain(self.dns.read().iter())
        {
            if !itself.contains(peer) && !all.contains(peer) {
                all.push(peer.clone());
            }
        }
        all
    }
}

/// Whether `response` is a daemon's answer that `instance` (the asker) is itself.
fn is_itself(response: &reqwest::Response, instance: &str) -> bool {
    response.status() == reqwest::StatusCode::CONFLICT
        && response
            .headers()
            .get(INSTANCE_HEADER)
            .is_some_and(|value| value.as_bytes() == instance.as_bytes())
}

/// A batch as [`PeerBookings`] reads it, written from the shared bookings.
#[derive(Serialize)]
struct Outgoing<'a> {
    bookings: Vec<&'a PeerBooking>,
}

/// A daemon's link to its peers: where its bookings are queued, and whom they go to.
pub struct Peering {
    /// Bookings made here, waiting to be sent (shared with the ledger, not copied).
    pub queue: mpsc::Sender<Arc<PeerBooking>>,
    /// The peers as configured now.
    pub list: Arc<PeerList>,
}

/// Starts sending this daemon's bookings to `peers`, with `token` as bearer if they
/// require one.
pub fn spawn(
    daemon: Arc<Daemon>,
    peers: Arc<PeerList>,
    token: Option<String>,
    client: reqwest::Client,
) -> Peering {
    let (queue, bookings) = mpsc::channel(QUEUE);
    tokio::spawn(forward(daemon, bookings, peers.clone(), token, client));
    Peering { queue, list: peers }
}

/// Sends what is queued to every peer, a batch at a time: what queues while a batch is on
/// its way goes in the next one.
async fn forward(
    daemon: Arc<Daemon>,
    mut queued: mpsc::Receiver<Arc<PeerBooking>>,
    peers: Arc<PeerList>,
    token: Option<String>,
    client: reqwest::Client,
) {
    let max_keys = daemon.settings.max_keys;
    let mut warned: std::collections::HashMap<String, Instant> = Default::default();
    let mut next: Option<Arc<PeerBooking>> = None;
    loop {
        let first = match next.take() {
            Some(first) => first,
            None => match queued.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let mut keys = first.held.keys();
        let mut batch = vec![first];
        while batch.len() < BATCH {
            let Ok(booking) = queued.try_recv() else {
                break;
            };
            keys += booking.held.keys();
            if keys > max_keys {
                next = Some(booking);
                break;
            }
            batch.push(booking);
        }
        let sent = batch.len() as u64;
        let targets = peers.current();
        let outgoing = Outgoing {
            bookings: batch.iter().map(Arc::as_ref).collect(),
        };
        let body = match serde_json::to_vec(&outgoing) {
            Ok(body) => axum::body::Bytes::from(body),
            Err(_) => continue,
        };
        let mut sends = tokio::task::JoinSet::new();
        for (i, peer) in targets.iter().enumerate() {
            let mut request = client
                .post(format!("http://{peer}{PEER_BOOKINGS_PATH}"))
                .header("content-type", "application/json")
                .header(INSTANCE_HEADER, daemon.instance.as_str())
                .timeout(SEND_TIMEOUT)
                .body(body.clone());
            if let Some(token) = &token {
                request = request.bearer_auth(token);
            }
            let instance = daemon.instance.clone();
            sends.spawn(async move {
                let result = match request.send().await {
                    Ok(response) if is_itself(&response, &instance) => Ok(false),
                    Ok(response) => response.error_for_status().map(|_| true),
                    Err(err) => Err(err),
                };
                (i, result)
            });
        }
        while let Some(Ok((i, result))) = sends.join_next().await {
            let peer = targets.get(i).map_or("", String::as_str);
            let outcome = match result {
                Ok(true) => "sent",
                Ok(false) => {
                    peers.itself(peer);
                    continue;
                }
                Err(err) => {
                    let now = Instant::now();
                    let due = warned
                        .get(peer)
                        .is_none_or(|t| now.duration_since(*t) >= WARNING_EVERY);
                    if due {
                        // Pods come and go under new addresses: forget the quiet ones.
                        warned.retain(|_, at| now.duration_since(*at) < WARNING_EVERY);
                        warned.insert(peer.to_owned(), now);
                        warn!(%peer, "bookings not shared with this peer: {err}");
                    }
                    "failed"
                }
            };
            daemon.metrics.count_peer_bookings(outcome, sent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booking(n: u64) -> PeerBooking {
        PeerBooking {
            endpoint: format!("10.0.0.{n}:8000"),
            rank: 0,
            work: 500,
            ttl_ms: 10_000,
            held: Held::Salt { salt: n },
        }
    }

    #[test]
    fn a_peers_speeds_are_its_own_measurements_once_per_replica() {
        let endpoints = serde_json::json!({"endpoints": [
            {"endpoint": "a:1", "rank": 0, "prefill": {"source": "measured",
                "measured_tokens_per_second": 2000.0, "measured_overhead_ms": 50.0}},
            {"endpoint": "a:1", "rank": 1, "prefill": {"source": "measured",
                "measured_tokens_per_second": 9000.0, "measured_overhead_ms": 1.0}},
            {"endpoint": "b:1", "prefill": {"source": "fleet",
                "measured_tokens_per_second": null, "measured_overhead_ms": null}},
            {"endpoint": "c:1", "prefill": {"measured_tokens_per_second": -5.0,
                "measured_overhead_ms": 1.0}},
            {"endpoint": "d:1"}
        ]});
        let speeds = measured_speeds(&endpoints);
        assert_eq!(speeds.len(), 1, "{speeds:?}");
        assert_eq!(speeds[0].0, "a:1");
        assert_eq!(speeds[0].1.tokens_per_second, 2000.0);
        assert!((speeds[0].1.overhead_tokens - 100.0).abs() < 1e-9);
        assert!(measured_speeds(&serde_json::json!({"endpoints": 3})).is_empty());
    }

    #[test]
    fn the_ledger_hands_on_live_bookings_only_and_the_newest_at_most() {
        let now = Instant::now();
        let mut ledger = Ledger::default();
        ledger.remember(Arc::new(booking(1)), now + Duration::from_secs(100), now);
        ledger.remember(Arc::new(booking(2)), now + Duration::from_millis(10), now);
        ledger.remember(Arc::new(booking(3)), now + Duration::from_secs(10), now);
        let later = now + Duration::from_secs(1);
        let handed = handed_on(&ledger.live(later), later).bookings;
        let salts: Vec<Held> = handed.iter().map(|b| b.held.clone()).collect();
        assert_eq!(salts, [Held::Salt { salt: 1 }, Held::Salt { salt: 3 }]);
        assert_eq!((handed[1].work, handed[1].ttl_ms), (0, 9_000));
        // Full: the expired go first (booking 2, behind a longer-lived one), then the
        // oldest.
        for n in 10..10 + LEDGER_BOOKINGS as u64 - 2 {
            ledger.remember(Arc::new(booking(n)), later + Duration::from_secs(10), later);
        }
        let live = ledger.live(later);
        assert_eq!(live.len(), LEDGER_BOOKINGS);
        assert_eq!(live[0].1.held, Held::Salt { salt: 1 });
        ledger.remember(Arc::new(booking(7)), later + Duration::from_secs(10), later);
        let live = ledger.live(later);
        assert_eq!(live.len(), LEDGER_BOOKINGS);
        assert_eq!(live[0].1.held, Held::Salt { salt: 3 });
        assert_eq!(
            live.last().map(|(_, b)| b.held.clone()),
            Some(Held::Salt { salt: 7 })
        );
    }

    #[test]
    fn the_ledger_is_bounded_by_keys_too() {
        let now = Instant::now();
        let mut ledger = Ledger::default();
        let big = |n: u64| PeerBooking {
            held: Held::Text {
                keys: vec![n; LEDGER_KEYS / 2],
            },
            ..booking(n)
        };
        for n in 0..3 {
            ledger.remember(Arc::new(big(n)), now + Duration::from_secs(10), now);
        }
        let live = ledger.live(now);
        assert_eq!(live.len(), 2);
        assert_eq!(live[0].1.held.keys(), LEDGER_KEYS / 2);
        assert_eq!(live[0].1.endpoint, "10.0.0.1:8000");
    }
}
