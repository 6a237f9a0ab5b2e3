//! A KV-event publisher that behaves as vLLM's `ZmqEventPublisher` does: a PUB socket
//! sending `[topic, seq_be8, payload]`, a ROUTER answering replay requests from a ring of
//! recent batches (vLLM >= 0.26 layout), seq counting from 0 per process.
//!
//! The sockets live on one thread (libzmq sockets are not shareable); callers talk to it
//! over an inproc pair, so a single poll waits on both and nothing spins.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use kvaffine_core::events::{self, BlockStored, EngineHash, EventBatch, EventFormat, KvEvent};
use kvaffine_core::{KeyConfig, KeyExtras};

/// vLLM's default `buffer_steps`: batches kept for replay.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// Why the publisher could not start or take a command.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A ZMQ call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// The publisher thread could not be started.
    #[error("cannot start the publisher thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// How to publish.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, vLLM style (`tcp://*:5557`; `tcp://127.0.0.1:*` picks a port).
    pub endpoint: String,
    /// Replay ROUTER endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    /// First frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Map (vLLM >= 0.24) or positional (<= 0.23) events.
    pub format: EventFormat,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:*".into(),
            replay_endpoint: Some("tcp://127.0.0.1:*".into()),
            topic: String::new(),
            buffer_steps: DEFAULT_BUFFER_STEPS,
            format: EventFormat::Map,
        }
    }
}

const CMD_PUBLISH: &[u8] = b"publish";
const CMD_BUFFER_ONLY: &[u8] = b"buffer-only";
const CMD_RAW: &[u8] = b"raw";
const CMD_STOP: &[u8] = b"stop";

static NEXT_PIPE: AtomicUsize = AtomicUsize::new(0);

/// A running publisher; dropping it stops the thread and closes the sockets.
pub struct EventPublisher {
    control: zmq::Socket,
    thread: Option<JoinHandle<()>>,
    format: EventFormat,
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl EventPublisher {
    /// Binds the sockets and starts the publishing thread.
    pub fn start(context: &zmq::Context, config: PublisherConfig) -> Result<Self, PublisherError> {
        let publisher = context.socket(zmq::PUB)?;
        publisher.set_linger(0)?;
        publisher.set_sndhwm(100_000)?;
        publisher.bind(&config.endpoint)?;
        let endpoint = last_endpoint(&publisher)?;
        let router = match &config.replay_endpoint {
            Some(url) => {
                let router = context.socket(zmq::ROUTER)?;
                router.set_linger(0)?;
                router.set_sndhwm(2 * (config.buffer_steps as i32 + 1))?;
                router.bind(url)?;
                Some(router)
            }
            None => None,
        };
        let replay_endpoint = router.as_ref().map(last_endpoint).transpose()?;
        let pipe = format!(
            "inproc://vllm-emu-publisher-{}",
            NEXT_PIPE.fetch_add(1, Ordering::Relaxed)
        );
        let worker_end = context.socket(zmq::PAIR)?;
        worker_end.bind(&pipe)?;
        let control = context.socket(zmq::PAIR)?;
        control.connect(&pipe)?;
        let topic = config.topic.clone().into_bytes();
        let buffer_steps = config.buffer_steps.max(1);
        let thread = std::thread::Builder::new()
            .name("kv-event publisher".into())
            .spawn(move || serve(publisher, router, worker_end, topic, buffer_steps))?;
        Ok(Self {
            control,
            thread: Some(thread),
            format: config.format,
            endpoint,
            replay_endpoint,
        })
    }

    /// The bound PUB endpoint (with the port actually chosen).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Publishes a batch under the next seq.
    pub fn publish(&self, batch: &EventBatch) -> Result<(), PublisherError> {
        let payload = events::encode_batch(batch, self.format);
        self.control.send_multipart([CMD_PUBLISH, &payload], 0)?;
        Ok(())
    }

    /// Takes the next seq and keeps the batch for replay, but never sends it live: a
    /// message lost on the way, as a slow subscriber loses messages past its HWM.
    pub fn publish_lost(&self, batch: &EventBatch) -> Result<(), PublisherError> {
        let payload = events::encode_batch(batch, self.format);
        self.control
            .send_multipart([CMD_BUFFER_ONLY, &payload], 0)?;
        Ok(())
    }

    /// Sends arbitrary frames on the PUB socket, outside the seq: for malformed input.
    pub fn publish_raw(&self, frames: &[&[u8]]) -> Result<(), PublisherError> {
        let mut message: Vec<&[u8]> = vec![CMD_RAW];
        message.extend_from_slice(frames);
        self.control.send_multipart(message, 0)?;
        Ok(())
    }
}

impl Drop for EventPublisher {
    fn drop(&mut self) {
        if self.control.send(CMD_STOP, 0).is_ok() {
            if let Some(thread) = self.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

fn last_endpoint(socket: &zmq::Socket) -> Result<String, PublisherError> {
    Ok(socket.get_last_endpoint()?.unwrap_or_default())
}

fn serve(
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    control: zmq::Socket,
    topic: Vec<u8>,
    buffer_steps: usize,
) {
    let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::with_capacity(buffer_steps.min(1024));
    let mut seq: u64 = 0;
    loop {
        let (command_ready, replay_ready) = {
            let mut items = vec![control.as_poll_item(zmq::POLLIN)];
            if let Some(router) = &router {
                items.push(router.as_poll_item(zmq::POLLIN));
            }
            if zmq::poll(&mut items, -1).is_err() {
                return;
            }
            (
                items.first().is_some_and(|i| i.is_readable()),
                items.get(1).is_some_and(|i| i.is_readable()),
            )
        };
        if command_ready {
            let Ok(frames) = control.recv_multipart(0) else {
                return;
            };
            let Some((command, rest)) = frames.split_first() else {
                continue;
            };
            match command.as_slice() {
                CMD_STOP => return,
                CMD_RAW => {
                    let _ = publisher.send_multipart(rest, 0);
                }
                CMD_PUBLISH | CMD_BUFFER_ONLY => {
                    let Some(payload) = rest.first() else {
                        continue;
                    };
                    if command.as_slice() == CMD_PUBLISH {
                        let frames = events::live_frames(&topic, seq, payload);
                        let _ = publisher.send_multipart(frames, 0);
                    }
                    if buffer.len() == buffer_steps {
                        buffer.pop_front();
                    }
                    buffer.push_back((seq, payload.clone()));
                    seq += 1;
                }
                _ => {}
            }
        }
        if let (true, Some(router)) = (replay_ready, &router) {
            while let Ok(request) = router.recv_multipart(zmq::DONTWAIT) {
                // vLLM answers only well-formed requests: [identity, "", start_seq].
                let Ok(start) = events::start_seq_of_replay_request(&request) else {
                    continue;
                };
                let Some(identity) = request.first() else {
                    continue;
                };
                for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                    let _ = router
                        .send_multipart(events::replay_frames(identity, &topic, *s, payload), 0);
                }
                let _ = router.send_multipart(events::replay_end_frames(identity), 0);
            }
        }
    }
}

/// A fresh prompt's `BlockStored`, as vLLM publishes it once prefilled: every full block
/// of `tokens` from the first, keyed with `keys`, engine hashes equal to the block keys.
/// For benchmarks and tests that publish without an engine.
pub fn stored_prompt(keys: &KeyConfig, tokens: Vec<u32>) -> KvEvent {
    let digests = keys.digests(&KeyExtras::default(), &tokens);
    KvEvent::BlockStored(BlockStored {
        block_hashes: digests
            .iter()
            .map(|d| EngineHash::Int(d.block_key().0))
            .collect(),
        extra_keys: Some(vec![None; digests.len()]),
        token_ids: tokens,
        block_size: keys.block_size() as u64,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..BlockStored::default()
    })
}

/// `events` as one batch of data-parallel rank 0, stamped `ts`.
pub fn batch_of(events: Vec<KvEvent>, ts: f64) -> EventBatch {
    EventBatch {
        ts,
        events,
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
    }
}
