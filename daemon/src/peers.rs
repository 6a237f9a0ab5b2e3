//! Bookings shared between daemons. Several gateways, each with a kvaffined beside it,
//! route to the same replicas: every daemon follows every replica's events, so their
//! indexes agree, but a pick is booked only in the daemon that made it. Siblings of a
//! fresh prefix that reach another gateway before the replica's events would then scatter,
//! and each daemon would count only its own gateway's queued prefill. With `--peer`, each
//! booking is also sent to the other daemons, which hold it as their own (without sending
//! it on): over the index API, with the daemon's own API token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::warn;

use crate::state::Daemon;

/// Where a daemon takes its peers' bookings.
pub const PEER_BOOKINGS_PATH: &str = "/v2/peer/bookings";

/// Bookings waiting to be sent; past it new ones are dropped and counted (a peer that
/// cannot keep up loses affinity, never the lookups' time).
const QUEUE: usize = 10_000;

/// Most bookings in one batch (their keys are bounded by `--max-keys` too), so a batch
/// stays within the body bound every daemon of the fleet shares.
const BATCH: usize = 256;

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
    /// Prefill work the pick queued on it, in uncached-token equivalents.
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

/// The daemons bookings go to (`HOST:PORT` of their API): the `--peer` flags and the
/// config file's `peers`, which changes when the file does (gateway pods come and go).
#[derive(Debug, Default)]
pub struct PeerList {
    flags: Vec<String>,
    file: parking_lot::RwLock<Vec<String>>,
}

impl PeerList {
    /// The `--peer` flags' peers, and none from a file yet.
    pub fn new(flags: Vec<String>) -> Self {
        Self {
            flags,
            file: parking_lot::RwLock::default(),
        }
    }

    /// The config file now names `peers`.
    pub fn set_file(&self, peers: Vec<String>) {
        *self.file.write() = peers;
    }

    /// Whether it names no peer now.
    pub fn is_empty(&self) -> bool {
        self.flags.is_empty() && self.file.read().is_empty()
    }

    /// Every peer, each once.
    pub fn current(&self) -> Vec<String> {
        let mut all = self.flags.clone();
        for peer in self.file.read().iter() {
            if !all.contains(peer) {
                all.push(peer.clone());
            }
        }
        all
    }
}

/// A daemon's link to its peers: where its bookings are queued, and whom they go to.
pub struct Peering {
    /// Bookings made here, waiting to be sent.
    pub queue: mpsc::Sender<PeerBooking>,
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
    mut queued: mpsc::Receiver<PeerBooking>,
    peers: Arc<PeerList>,
    token: Option<String>,
    client: reqwest::Client,
) {
    let max_keys = daemon.settings.max_keys;
    let mut warned: std::collections::HashMap<String, Instant> = Default::default();
    let mut next: Option<PeerBooking> = None;
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
        let peers = peers.current();
        let body = match serde_json::to_vec(&PeerBookings { bookings: batch }) {
            Ok(body) => axum::body::Bytes::from(body),
            Err(_) => continue,
        };
        let mut sends = tokio::task::JoinSet::new();
        for (i, peer) in peers.iter().enumerate() {
            let mut request = client
                .post(format!("http://{peer}{PEER_BOOKINGS_PATH}"))
                .header("content-type", "application/json")
                .timeout(SEND_TIMEOUT)
                .body(body.clone());
            if let Some(token) = &token {
                request = request.bearer_auth(token);
            }
            sends.spawn(async move {
                let result = match request.send().await {
                    Ok(response) => response.error_for_status().map(|_| ()),
                    Err(err) => Err(err),
                };
                (i, result)
            });
        }
        while let Some(Ok((i, result))) = sends.join_next().await {
            let outcome = match result {
                Ok(()) => "sent",
                Err(err) => {
                    let now = Instant::now();
                    let peer = peers.get(i).map_or("", String::as_str);
                    let due = warned
                        .get(peer)
                        .is_none_or(|t| now.duration_since(*t) >= WARNING_EVERY);
                    if due {
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
