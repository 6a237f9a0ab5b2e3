//! One replica's engine: admission under a running-sequence limit and the KV capacity, a
//! latency model calibrated to a measured GPT-OSS-20B replica, and the KV events the
//! cache produces.

use std::collections::HashMap;
use std::time::Duration;

use kvaffine_core::events::KvEvent;
use kvaffine_core::{Digest, KeyConfig, KeyExtras};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};

use crate::cache::{EngineHashMode, Holding, PrefixCache};

/// Milliseconds of engine time per unit of work, before `--time-scale`.
///
/// Calibration (one GPT-OSS-20B replica): a 12,944-token prompt took 2,617 ms and
/// 2,575.5 ms cold (two salts) and 283 ms with 12,928 tokens cached. With a 40 ms fixed
/// overhead that gives 0.1955 ms per uncached and 0.0186 ms per cached token; decode runs
/// at 8 ms per output token (about 120 tokens/s for one sequence).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeModel {
    /// Multiplies every duration; 0 makes the engine instant.
    pub scale: f64,
    /// Per request.
    pub overhead_ms: f64,
    /// Per prompt token not served from the cache.
    pub uncached_ms: f64,
    /// Per prompt token served from the cache.
    pub cached_ms: f64,
    /// Per generated token.
    pub output_ms: f64,
}

impl Default for TimeModel {
    fn default() -> Self {
        Self {
            scale: 1.0,
            overhead_ms: 40.0,
            uncached_ms: 0.1955,
            cached_ms: 0.0186,
            output_ms: 8.0,
        }
    }
}

impl TimeModel {
    fn duration(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms * self.scale).max(0.0) / 1e3)
    }

    /// Prefill time of a prompt of `prompt` tokens with `cached` served from the cache.
    pub fn prefill(&self, prompt: usize, cached: usize) -> Duration {
        self.duration(
            self.overhead_ms
                + prompt.saturating_sub(cached) as f64 * self.uncached_ms
                + cached as f64 * self.cached_ms,
        )
    }

    /// Time of one decode step.
    pub fn decode_step(&self) -> Duration {
        self.duration(self.output_ms)
    }
}

/// Why a request cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The prompt needs more blocks than the whole cache holds.
    #[error("the prompt needs {need} KV blocks but the cache holds {capacity}")]
    TooLong {
        /// Blocks the prompt needs.
        need: usize,
        /// Blocks the cache has.
        capacity: usize,
    },
}

/// Counters `/metrics` reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// KV-cache usage, 0-1.
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens served from it.
    pub prefix_hits: u64,
    /// Finished requests (the count of both request histograms below).
    pub finished: u64,
    /// Seconds finished requests spent in prefill, from scheduled to first token
    /// (`vllm:request_prefill_time_seconds_sum`).
    pub prefill_seconds: f64,
    /// Prompt tokens finished requests computed, cache hits left out
    /// (`vllm:request_prefill_kv_computed_tokens_sum`).
    pub computed_tokens: u64,
}

struct State {
    cache: PrefixCache,
    running: usize,
    waiting: usize,
    /// Admitted requests whose prefill has not started.
    prefill_queued: usize,
    prefix_queries: u64,
    prefix_hits: u64,
    finished: u64,
    prefill_seconds: f64,
    computed_tokens: u64,
}

/// A request holding its admission; [`Engine::finish`] gives it back.
pub struct Admission {
    holding: Holding,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    digests: Vec<Digest>,
    /// Its prefill, once run: seconds from scheduled to done, and tokens computed.
    prefill: Option<(f64, usize)>,
}

/// The shared engine of one replica.
pub struct Engine {
    keys: KeyConfig,
    max_num_seqs: usize,
    capacity: usize,
    /// The timing model.
    pub time: TimeModel,
    state: Mutex<State>,
    admitted: Notify,
    prefill_lane: tokio::sync::Mutex<()>,
    events: mpsc::UnboundedSender<Vec<KvEvent>>,
    /// LoRA adapter paths by name.
    pub loras: HashMap<String, String>,
}

impl Engine {
    /// An engine whose cache has `num_gpu_blocks` blocks; its events go to `events`.
    pub fn new(
        keys: KeyConfig,
        num_gpu_blocks: usize,
        max_num_seqs: usize,
        time: TimeModel,
        mode: EngineHashMode,
        loras: HashMap<String, String>,
        events: mpsc::UnboundedSender<Vec<KvEvent>>,
    ) -> Self {
        let cache = PrefixCache::new(num_gpu_blocks, keys.block_size(), mode);
        Self {
            keys,
            max_num_seqs: max_num_seqs.max(1),
            capacity: num_gpu_blocks,
            time,
            state: Mutex::new(State {
                cache,
                running: 0,
                waiting: 0,
                prefill_queued: 0,
                prefix_queries: 0,
                prefix_hits: 0,
                finished: 0,
                prefill_seconds: 0.0,
                computed_tokens: 0,
            }),
            admitted: Notify::new(),
            prefill_lane: tokio::sync::Mutex::new(()),
            events,
            loras,
        }
    }

    /// The same engine serving a hybrid-attention model: a sliding-window group of
    /// `window` tokens beside full attention (see [`PrefixCache::with_window`]).
    pub fn with_sliding_window(mut self, window: u64) -> Self {
        let state = self.state.get_mut();
        let cache = std::mem::replace(
            &mut state.cache,
            PrefixCache::new(0, self.keys.block_size(), EngineHashMode::Keys),
        );
        state.cache = cache.with_window(window);
        self
    }

    /// The key configuration the cache keys blocks with.
    pub fn keys(&self) -> &KeyConfig {
        &self.keys
    }

    fn digests(&self, tokens: &[u32], extras: &KeyExtras) -> Vec<Digest> {
        self.keys.digests(extras, tokens)
    }

    fn flush(&self, state: &mut State) {
        let events = state.cache.take_events();
        if !events.is_empty() {
            // The publisher task ends only with the process.
            let _ = self.events.send(events);
        }
    }

    /// Refuses, before anything is streamed, a prompt the cache could never hold.
    pub fn check_fits(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let need = tokens.len() / self.keys.block_size() + 1;
        if need > self.capacity {
            return Err(EngineError::TooLong {
                need,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Waits until the request can run (a free sequence slot and enough KV blocks), then
    /// takes its blocks. Cached blocks are used up to the last full block before the final
    /// token, which vLLM always recomputes.
    pub async fn admit(
        &self,
        tokens: &[u32],
        extras: &KeyExtras,
    ) -> Result<Admission, EngineError> {
        let block_size = self.keys.block_size();
        let digests = self.digests(tokens, extras);
        let need = self.state.lock().cache.admission_need(digests.len());
        if need > self.capacity {
            return Err(EngineError::TooLong {
                need,
                capacity: self.capacity,
            });
        }
        let hit_cap = tokens.len().saturating_sub(1) / block_size;
        self.state.lock().waiting += 1;
        loop {
            let notified = self.admitted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.state.lock();
                if state.running < self.max_num_seqs {
                    let mut holding = Holding::default();
                    // Without capacity now, wait for a running request to finish.
                    if let Ok(hits) = state.cache.admit(&digests, hit_cap, &mut holding) {
                        state.waiting -= 1;
                        state.running += 1;
                        let cached_tokens = hits * block_size;
                        state.prefix_queries += tokens.len() as u64;
                        state.prefix_hits += cached_tokens as u64;
                        self.flush(&mut state);
                        return Ok(Admission {
                            holding,
                            cached_tokens,
                            digests,
                            prefill: None,
                        });
                    }
                }
            }
            notified.await;
        }
    }

    /// Runs the prefill of an admitted prompt: prefills share the engine one at a time,
    /// and a request whose prefill has not started counts as waiting (vLLM's scheduler
    /// keeps it in its waiting queue until its prefill is scheduled).
    pub async fn prefill(&self, tokens: &[u32], extras: &KeyExtras, admission: &mut Admission) {
        let timed = !self
            .time
            .prefill(tokens.len(), admission.cached_tokens)
            .is_zero();
        let _lane = if timed {
            self.state.lock().prefill_queued += 1;
            let lane = self.prefill_lane.lock().await;
            self.state.lock().prefill_queued -= 1;
            Some(lane)
        } else {
            None
        };
        // Scheduled now: what requests ahead of it cached meanwhile is a hit too.
        let scheduled = std::time::Instant::now();
        {
            let block_size = self.keys.block_size();
            let hit_cap = tokens.len().saturating_sub(1) / block_size;
            let mut state = self.state.lock();
            let adopted =
                state
                    .cache
                    .adopt_cached(&admission.digests, hit_cap, &mut admission.holding)
                    * block_size;
            admission.cached_tokens += adopted;
            state.prefix_hits += adopted as u64;
        }
        let duration = self.time.prefill(tokens.len(), admission.cached_tokens);
        if timed {
            tokio::time::sleep(duration).await;
        }
        admission.prefill = Some((
            scheduled.elapsed().as_secs_f64(),
            tokens.len().saturating_sub(admission.cached_tokens),
        ));
        let mut state = self.state.lock();
        let digests = std::mem::take(&mut admission.digests);
        state
            .cache
            .commit_prefill(tokens, &digests, extras, &mut admission.holding);
        self.flush(&mut state);
    }

    /// One decode step.
    pub async fn decode_step(&self) {
        let step = self.time.decode_step();
        if !step.is_zero() {
            tokio::time::sleep(step).await;
        }
    }

    /// The request is done: cache the blocks its generated tokens filled, then release.
    pub fn finish(&self, all_tokens: &[u32], extras: &KeyExtras, mut admission: Admission) {
        let digests = self.digests(all_tokens, extras);
        let mut state = self.state.lock();
        state
            .cache
            .extend(all_tokens, &digests, extras, &mut admission.holding);
        state.cache.release(admission.holding);
        state.running -= 1;
        // vLLM observes its request histograms when a request finishes.
        if let Some((seconds, computed)) = admission.prefill {
            state.finished += 1;
            state.prefill_seconds += seconds;
            state.computed_tokens += computed as u64;
        }
        self.flush(&mut state);
        drop(state);
        self.admitted.notify_waiters();
    }

    /// Prompt tokens a request would be served from the cache right now (no change to the
    /// cache): what a router with perfect knowledge could get from this replica.
    pub fn cached_tokens(&self, tokens: &[u32], extras: &KeyExtras) -> usize {
        let block_size = self.keys.block_size();
        let digests = self.digests(tokens, extras);
        let hit_cap = tokens.len().saturating_sub(1) / block_size;
        self.state.lock().cache.hit(&digests, hit_cap) * block_size
    }

    /// `POST /reset_prefix_cache`; false while requests run. Its `AllBlocksCleared` goes
    /// out with the next step's events, as vLLM publishes it (0.32: queued by the block
    /// pool, taken at the next engine step): until then a subscriber that replays the
    /// stream takes the blocks stored before the reset as held.
    pub fn reset(&self) -> bool {
        self.state.lock().cache.reset()
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        let state = self.state.lock();
        EngineStats {
            running: state.running - state.prefill_queued,
            waiting: state.waiting + state.prefill_queued,
            kv_cache_usage: state.cache.usage(),
            prefix_queries: state.prefix_queries,
            prefix_hits: state.prefix_hits,
            finished: state.finished,
            prefill_seconds: state.prefill_seconds,
            computed_tokens: state.computed_tokens,
        }
    }
}
