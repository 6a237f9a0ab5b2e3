//! Following one replica's KV events: a ZMQ SUB for the live stream and a DEALER for
//! replays, on a thread of its own (libzmq sockets are blocking and not shareable across
//! threads), applying to the shared index under a short write lock per batch.

mod apply;
mod sequencer;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use kvaffine_core::events::{self, EventBatch, KvEvent, ReplayMessage};
use tracing::{debug, error, info, warn};

pub use apply::{Alignment, Applier, ApplyReport};
pub use sequencer::{Action, Sequencer};

use crate::hybrid::{Layout, Rule};
use crate::metrics::EventLabel;
use crate::state::{Daemon, Endpoint};

/// How long a poll waits before the thread checks its timers (a replay's deadline, a
/// stream down too long) and whether it should stop, while something is pending.
const POLL: Duration = Duration::from_millis(50);
/// The same with nothing pending: a thousand streams polling every 50 ms kept a core half
/// busy doing nothing (`bench streams`, `docs/benchmarks/scale.md`).
const IDLE_POLL: Duration = Duration::from_millis(500);
/// Messages a SUB socket queues before libzmq drops (vLLM's own publisher uses the same).
pub(crate) const RECEIVE_HWM: i32 = 100_000;

/// Starts following `endpoint`; the thread ends when `endpoint.stop` is set.
pub fn spawn(
    daemon: Arc<Daemon>,
    endpoint: Arc<Endpoint>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("ingest {}", endpoint.spec.endpoint))
        .spawn(move || {
            if let Err(err) = run(&daemon, &endpoint) {
                error!(endpoint = %endpoint.spec.endpoint, "event ingestion stopped: {err:#}");
                endpoint.status.lock().incomplete =
                    Some(format!("event ingestion stopped: {err:#}"));
            }
        })
}

/// The live stream's connection as the SUB socket's monitor reports it. libzmq reconnects
/// by itself after a network error but never after a protocol error (a message past the
/// byte bound, a malformed greeting), so a stream down too long is connected again by
/// hand, backing off while it keeps failing.
#[derive(Debug, Default)]
struct Link {
    /// Since when it is down, if it is.
    down_since: Option<Instant>,
    /// When it last came up.
    up_since: Option<Instant>,
    /// How long to wait before connecting again by hand; doubles each time it fails.
    backoff: Duration,
}

/// The first wait before a stream still down is connected again by hand, and the most.
const RECONNECT_FIRST: Duration = Duration::from_secs(1);
const RECONNECT_MOST: Duration = Duration::from_secs(30);

impl Link {
    fn lost(&mut self, now: Instant) {
        // A link that stayed up a while starts its backoff over.
        if self.up_since.is_some_and(|up| now - up >= RECONNECT_MOST) {
            self.backoff = Duration::ZERO;
        }
        self.down_since.get_or_insert(now);
        self.up_since = None;
    }

    /// Records a connection; true if the stream had been down.
    fn found(&mut self, now: Instant) -> bool {
        self.up_since = Some(now);
        self.down_since.take().is_some()
    }

    /// Whether to connect again by hand now (and when next).
    fn reconnect_due(&mut self, now: Instant) -> bool {
        let Some(since) = self.down_since else {
            return false;
        };
        let wait = self.backoff.max(RECONNECT_FIRST);
        if now - since < wait {
            return false;
        }
        self.backoff = (wait * 2).min(RECONNECT_MOST);
        self.down_since = Some(now);
        true
    }
}

struct Follower<'a> {
    daemon: &'a Daemon,
    endpoint: &'a Endpoint,
    sequencer: Sequencer,
    applier: Applier,
    /// The replay socket. Every replay request gets a fresh one, so the tail of an
    /// abandoned or superseded replay can never be mistaken for the new one's.
    dealer: Option<zmq::Socket>,
    replay_url: Option<String>,
    replay_started: Option<Instant>,
    warned_unknown_types: bool,
    /// When an undecodable message was last warned about.
    decode_warned: Option<Instant>,
    /// When dropped index entries were last warned about.
    dropped_warned: Option<Instant>,
}

/// Undecodable messages, and dropped index entries, are warned about at most this often
/// per endpoint.
const WARNING_EVERY: Duration = Duration::from_secs(10);

fn run(daemon: &Daemon, endpoint: &Endpoint) -> anyhow::Result<()> {
    let spec = &endpoint.spec;
    let sub = daemon.zmq(endpoint.slot).socket(zmq::SUB)?;
    sub.set_linger(0)?;
    sub.set_rcvhwm(RECEIVE_HWM)?;
    sub.set_maxmsgsize(daemon.settings.max_event_message_bytes)?;
    // libzmq connects to IPv4 only unless told otherwise; replicas may be IPv6 pods.
    sub.set_ipv6(true)?;
    sub.connect(&spec.events)
        .with_context(|| format!("cannot connect to {}", spec.events))?;
    sub.set_subscribe(daemon.settings.topic.as_bytes())?;
    // Connection events of the SUB socket: a reconnect may be to a restarted replica. The
    // name is never reused: libzmq unbinds a closed socket's monitor asynchronously, so an
    // endpoint re-added at the same slot would find the old name still taken.
    static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let monitor_url = format!(
        "inproc://kvaffined-monitor-{}",
        MONITORS.fetch_add(1, Ordering::Relaxed)
    );
    sub.monitor(
        &monitor_url,
        (zmq::SocketEvent::CONNECTED.to_raw() | zmq::SocketEvent::DISCONNECTED.to_raw()) as i32,
    )?;
    let monitor = daemon.zmq(endpoint.slot).socket(zmq::PAIR)?;
    monitor.set_linger(0)?;
    monitor.connect(&monitor_url)?;
    let mut link = Link::default();
    let lora_paths = Arc::new(daemon.settings.lora_paths.clone());
    let mut follower = Follower {
        daemon,
        endpoint,
        sequencer: Sequencer::new(spec.replay.is_some()),
        applier: Applier::new(endpoint.slot, daemon.settings.keys.clone(), lora_paths),
        dealer: None,
        replay_url: spec.replay.clone(),
        replay_started: None,
        warned_unknown_types: false,
        decode_warned: None,
        dropped_warned: None,
    };
    info!(endpoint = %spec.endpoint, events = %spec.events, replay = ?spec.replay, "following KV events");
    if follower.replay_url.is_none() {
        let mut status = endpoint.status.lock();
        status.synced = true;
        status.incomplete =
            Some("no replay endpoint: events missed before connecting or in a gap are lost".into());
        drop(status);
        daemon
            .metrics
            .incomplete
            .get_or_create(&endpoint.label)
            .set(1);
    }
    let actions = follower.sequencer.on_connect();
    follower.perform(actions)?;
    while !endpoint.stop.load(Ordering::Relaxed) {
        let (live_ready, monitor_ready, replay_ready) = {
            let mut items = vec![
                sub.as_poll_item(zmq::POLLIN),
                monitor.as_poll_item(zmq::POLLIN),
            ];
            if let Some(dealer) = &follower.dealer {
                items.push(dealer.as_poll_item(zmq::POLLIN));
            }
            let pending = follower.replay_started.is_some() || link.down_since.is_some();
            let wait = if pending { POLL } else { IDLE_POLL };
            zmq::poll(&mut items, wait.as_millis() as i64)?;
            let ready = |i: usize| items.get(i).is_some_and(|i| i.is_readable());
            (ready(0), ready(1), ready(2))
        };
        if monitor_ready {
            while let Ok(event) = monitor.recv_multipart(zmq::DONTWAIT) {
                let code = event
                    .first()
                    .and_then(|f| f.get(..2))
                    .map(|b| u16::from_le_bytes([b[0], b[1]]));
                if code == Some(zmq::SocketEvent::DISCONNECTED.to_raw()) {
                    info!(endpoint = %spec.endpoint, "event stream disconnected: ranking it last until it is back");
                    link.lost(Instant::now());
                    endpoint.status.lock().events_disconnected = true;
                } else if code == Some(zmq::SocketEvent::CONNECTED.to_raw())
                    && link.found(Instant::now())
                {
                    endpoint.status.lock().events_disconnected = false;
                    info!(endpoint = %spec.endpoint, "event stream reconnected: checking for a restart");
                    let actions = follower.sequencer.on_reconnect();
                    follower.perform(actions)?;
                }
            }
        }
        if link.reconnect_due(Instant::now()) {
            // libzmq retries a refused or lost connection by itself, but not one it
            // dropped for a protocol error (a message past --max-event-message-bytes).
            info!(endpoint = %spec.endpoint, "event stream still down: connecting again");
            let _ = sub.disconnect(&spec.events);
            if let Err(err) = sub.connect(&spec.events) {
                warn!(endpoint = %spec.endpoint, "cannot connect to {}: {err}", spec.events);
            }
        }
        if live_ready {
            while let Ok(frames) = sub.recv_multipart(zmq::DONTWAIT) {
                follower.live(&frames)?;
            }
        }
        if replay_ready {
            while let Some(frames) = follower
                .dealer
                .as_ref()
                .and_then(|d| d.recv_multipart(zmq::DONTWAIT).ok())
            {
                follower.replayed(&frames)?;
            }
        }
        if follower
            .replay_started
            .is_some_and(|t| t.elapsed() > daemon.settings.replay_timeout)
        {
            warn!(endpoint = %spec.endpoint, "replay did not finish in time");
            let actions = follower.sequencer.on_replay_end(true);
            follower.replay_started = None;
            follower.dealer = None;
            follower.perform(actions)?;
            follower.mark_synced();
        }
    }
    Ok(())
}

impl Follower<'_> {
    fn live(&mut self, frames: &[Vec<u8>]) -> anyhow::Result<()> {
        match events::parse_live(frames) {
            Ok(message) => {
                let actions = self
                    .sequencer
                    .on_live(message.seq, message.payload.to_vec());
                self.perform(actions)
            }
            Err(err) => {
                self.decode_error(&format!("live message: {err}"));
                Ok(())
            }
        }
    }

    fn replayed(&mut self, frames: &[Vec<u8>]) -> anyhow::Result<()> {
        match events::parse_replay(frames) {
            Ok(ReplayMessage::Batch { seq, payload, .. }) => {
                let actions = self.sequencer.on_replay_batch(seq, payload.to_vec());
                self.perform(actions)
            }
            Ok(ReplayMessage::End) => {
                let actions = self.sequencer.on_replay_end(false);
                self.replay_started = None;
                self.dealer = None;
                self.perform(actions)?;
                self.mark_synced();
                Ok(())
            }
            Err(err) => {
                self.decode_error(&format!("replay message: {err}"));
                Ok(())
            }
        }
    }

    fn mark_synced(&self) {
        let mut status = self.endpoint.status.lock();
        if !status.synced {
            info!(endpoint = %self.endpoint.spec.endpoint, next_seq = ?self.sequencer.next_seq(), "caught up with the event stream");
        }
        status.synced = true;
    }

    /// Counts an undecodable frame or payload, shows it in `/v1/endpoints`, and warns at
    /// most once per [`WARNING_EVERY`] so a broken or hostile publisher cannot
    /// flood the log.
    fn decode_error(&mut self, what: &str) {
        self.daemon
            .metrics
            .decode_errors
            .get_or_create(&self.endpoint.label)
            .inc();
        let count = {
            let mut status = self.endpoint.status.lock();
            status.decode_errors += 1;
            status.last_decode_error = Some(what.to_owned());
            status.decode_errors
        };
        let due = self
            .decode_warned
            .is_none_or(|at| at.elapsed() >= WARNING_EVERY);
        if due {
            self.decode_warned = Some(Instant::now());
            warn!(endpoint = %self.endpoint.spec.endpoint, total = count, "undecodable {what} (further ones for {} s are only counted)", WARNING_EVERY.as_secs());
        } else {
            debug!(endpoint = %self.endpoint.spec.endpoint, "undecodable {what}");
        }
    }

    fn perform(&mut self, actions: Vec<Action>) -> anyhow::Result<()> {
        let mut queue = std::collections::VecDeque::from(actions);
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Apply { seq, payload } => {
                    if let Some(more) = self.apply(seq, &payload) {
                        queue.extend(more);
                    }
                }
                Action::RequestReplay(from) => {
                    if let Some(url) = &self.replay_url {
                        let dealer = self.daemon.zmq(self.endpoint.slot).socket(zmq::DEALER)?;
                        dealer.set_linger(0)?;
                        dealer.set_maxmsgsize(self.daemon.settings.max_event_message_bytes)?;
                        dealer.set_ipv6(true)?;
                        dealer
                            .connect(url)
                            .with_context(|| format!("cannot connect to {url}"))?;
                        let [delimiter, start] = events::replay_request(from);
                        dealer.send_multipart([delimiter, start], 0)?;
                        self.dealer = Some(dealer);
                        self.replay_started = Some(Instant::now());
                        self.daemon
                            .metrics
                            .replays
                            .get_or_create(&self.endpoint.label)
                            .inc();
                        debug!(endpoint = %self.endpoint.spec.endpoint, from, "replay requested");
                    }
                }
                Action::Purge => {
                    warn!(endpoint = %self.endpoint.spec.endpoint, "sequence went backwards: the replica restarted; purging its blocks");
                    self.purge();
                    self.daemon
                        .metrics
                        .restarts
                        .get_or_create(&self.endpoint.label)
                        .inc();
                }
                Action::Complete => {
                    if self.endpoint.status.lock().incomplete.take().is_some() {
                        info!(endpoint = %self.endpoint.spec.endpoint, "index whole again: rebuilt from the replica's first batch");
                    }
                    self.daemon
                        .metrics
                        .incomplete
                        .get_or_create(&self.endpoint.label)
                        .set(0);
                }
                Action::Incomplete(reason) => {
                    warn!(endpoint = %self.endpoint.spec.endpoint, "index incomplete: {reason}");
                    self.daemon
                        .metrics
                        .gaps
                        .get_or_create(&self.endpoint.label)
                        .inc();
                    self.daemon
                        .metrics
                        .incomplete
                        .get_or_create(&self.endpoint.label)
                        .set(1);
                    self.endpoint.status.lock().incomplete = Some(reason);
                }
            }
        }
        self.endpoint.status.lock().next_seq = self.sequencer.next_seq();
        Ok(())
    }

    fn purge(&mut self) {
        let slot = self.endpoint.slot;
        self.daemon.index.write().purge(slot);
        self.daemon.bookings.write().forget_slot(slot);
        self.daemon.backlogs.lock().forget_slot(slot);
        self.applier.reset();
        let mut status = self.endpoint.status.lock();
        status.kv_cache_groups = Layout::default();
        if status.kv_cache_unsupported.take().is_some() {
            self.daemon
                .metrics
                .kv_cache_unsupported
                .get_or_create(&self.endpoint.label)
                .set(0);
        }
        status.rule = Arc::default();
    }

    /// Decodes and applies one batch; returns follow-up actions when it must resync.
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Option<Vec<Action>> {
        let batch = match events::decode_batch(payload) {
            Ok(batch) => batch,
            Err(err) => {
                self.decode_error(&format!("batch {seq}: {err}"));
                return Some(vec![Action::Incomplete(format!(
                    "batch {seq} did not decode: {err}"
                ))]);
            }
        };
        let before = self.applier.alignment();
        let report = {
            let mut index = self.daemon.index.write();
            self.applier.apply(&batch, &mut index)
        };
        if !report.stored_keys.is_empty() {
            self.daemon
                .bookings
                .write()
                .confirm(self.endpoint.slot, &report.stored_keys);
        }
        if !report.stored_keys.is_empty() || !report.stored_salts.is_empty() {
            // Salt-routed picks are queued under their salt's tag (`Daemon::probe`).
            let done: Vec<u64> = report
                .stored_keys
                .iter()
                .chain(&report.stored_salts)
                .copied()
                .collect();
            let now = std::time::Instant::now();
            let confirmed = self
                .daemon
                .backlogs
                .lock()
                .confirm(self.endpoint.slot, &done, now);
            if let Some(confirmed) = confirmed {
                let changed = self
                    .endpoint
                    .status
                    .lock()
                    .speed
                    .observe_confirmed(confirmed, now);
                if changed {
                    self.daemon.speeds_changed(now);
                }
            }
        }
        self.record(&batch, &report, before);
        // Bookings stay: they hold kvaffine's own keys of what the filter sent, true in
        // whatever key space the replica publishes. Forgetting them here left a
        // continuation sent while a re-keyed replica replays routed by load alone.
        report.needs_resync.then(|| self.sequencer.resync())
    }

    fn record(&mut self, batch: &EventBatch, report: &ApplyReport, before: Alignment) {
        let metrics = &self.daemon.metrics;
        let label = &self.endpoint.label;
        for event in &batch.events {
            let name = match event {
                KvEvent::BlockStored(_) => "BlockStored",
                KvEvent::BlockRemoved(_) => "BlockRemoved",
                KvEvent::AllBlocksCleared => "AllBlocksCleared",
            };
            metrics
                .events_applied
                .get_or_create(&EventLabel {
                    endpoint: label.endpoint.clone(),
                    event: name.to_owned(),
                })
                .inc();
        }
        if report.orphans > 0 {
            metrics
                .orphans
                .get_or_create(label)
                .inc_by(report.orphans as u64);
        }
        if report.dropped > 0 {
            metrics
                .dropped_entries
                .get_or_create(label)
                .inc_by(report.dropped as u64);
            let total = {
                let mut status = self.endpoint.status.lock();
                status.dropped_entries += report.dropped as u64;
                status.dropped_entries
            };
            if self
                .dropped_warned
                .is_none_or(|at| at.elapsed() >= WARNING_EVERY)
            {
                self.dropped_warned = Some(Instant::now());
                warn!(endpoint = %label.endpoint, total, "its blocks are being dropped: it holds its share of --max-entries, or the index is full (further drops for {} s are only counted)", WARNING_EVERY.as_secs());
            }
        }
        if batch.skipped_unknown > 0 && !self.warned_unknown_types {
            self.warned_unknown_types = true;
            warn!(endpoint = %label.endpoint, "skipping KV events of unknown types (a newer vLLM?)");
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let lag = (now - batch.ts).max(0.0);
        metrics.event_lag.observe(lag);
        let after = self.applier.alignment();
        if after != before {
            for mode in [Alignment::Unknown, Alignment::Aligned, Alignment::Rekeyed] {
                metrics
                    .alignment
                    .get_or_create(&crate::metrics::ModeLabel {
                        endpoint: label.endpoint.clone(),
                        mode: mode.as_str().to_owned(),
                    })
                    .set(i64::from(mode == after));
            }
            match after {
                Alignment::Rekeyed => error!(
                    endpoint = %label.endpoint,
                    "published block hashes are not kvaffine's keys (vLLM's default pickle `sha256`, or another PYTHONHASHSEED?): re-keying from token ids. Run vLLM with --prefix-caching-hash-algo sha256_cbor to avoid the extra work"
                ),
                Alignment::Aligned => {
                    info!(endpoint = %label.endpoint, "published block hashes are kvaffine's keys")
                }
                Alignment::Unknown => {}
            }
        }
        let mut status = self.endpoint.status.lock();
        status.events_applied += batch.events.len() as u64;
        status.last_event_lag_ms = Some(lag * 1e3);
        status.alignment = after.as_str();
        status.rekey_entries = self.applier.rekey_entries();
        if report.layout_changed {
            let layout = self.applier.layout().clone();
            let rule = layout.rule(self.daemon.settings.keys.block_size() as u64);
            let unsupported = match &rule {
                Rule::Unsupported(why) => Some(why.clone()),
                Rule::Prefix(_) | Rule::Hybrid { .. } => None,
            };
            match (&rule, &unsupported) {
                (_, Some(why)) if status.kv_cache_unsupported.as_ref() != Some(why) => {
                    error!(endpoint = %label.endpoint, "{why}");
                }
                (Rule::Hybrid { .. }, _) => info!(
                    endpoint = %label.endpoint,
                    groups = %serde_json::to_string(&layout).unwrap_or_default(),
                    "hybrid attention: a hit needs every sliding-window group's window before it"
                ),
                _ => {}
            }
            metrics
                .kv_cache_unsupported
                .get_or_create(label)
                .set(i64::from(unsupported.is_some()));
            status.kv_cache_groups = layout;
            status.kv_cache_unsupported = unsupported;
            status.rule = Arc::new(rule);
        }
        if let Some(size) = report.foreign_block_size {
            let reason = format!(
                "events report block size {size}, the daemon runs with {}",
                self.daemon.settings.keys.block_size()
            );
            if status.misconfigured.as_deref() != Some(reason.as_str()) {
                error!(endpoint = %label.endpoint, "misconfigured: {reason}");
                metrics.misconfigured.get_or_create(label).set(1);
                status.misconfigured = Some(reason);
                status.misconfigured_by_events = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_down_is_connected_again_by_hand_backing_off_until_it_stays_up() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut link = Link::default();
        assert!(!link.reconnect_due(at(100)), "never down");
        link.lost(at(0));
        assert!(!link.reconnect_due(at(0)));
        assert!(link.reconnect_due(at(1)));
        // Still down: next after 2 s, then 4 s.
        assert!(!link.reconnect_due(at(2)));
        assert!(link.reconnect_due(at(3)));
        assert!(link.reconnect_due(at(7)));
        // Up for a moment and down again (a publisher that keeps breaking): the backoff
        // goes on growing.
        assert!(link.found(at(7)));
        link.lost(at(8));
        assert!(!link.reconnect_due(at(15)));
        assert!(link.reconnect_due(at(16)));
        // Up long enough: it starts over at a second.
        assert!(link.found(at(16)));
        link.lost(at(100));
        assert!(link.reconnect_due(at(101)));
        assert!(link.found(at(101)), "it was down");
        assert!(!link.found(at(102)), "already up");
    }
}
