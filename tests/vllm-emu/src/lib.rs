//! vllm-emu: the parts of vLLM a KV-aware router can observe, reproduced exactly, so
//! tests and benchmarks run without a GPU.
//!
//! * [`publisher`]: vLLM's `ZmqEventPublisher` (PUB stream, replay ROUTER, seq from 0).
//! * [`tokenizer`], [`template`]: a deterministic tokenizer and a non-append-only
//!   reasoning-model chat template.
//! * [`cache`], [`engine`]: the prefix cache, admission, the latency model, events.
//! * [`generate`]: deterministic outputs a client can carry back.
//! * [`rng`]: the seeded generator every replayable workload shares.
//! * [`responses`]: Responses requests to chat messages, as vLLM builds them.
//! * [`harness`]: test support for suites that run real processes.
//! * [`server`]: the HTTP API (`/tokenize`, chat completions, completions, Responses,
//!   `/metrics`, `/kv_event_sources`, ...).

pub mod cache;
pub mod engine;
pub mod generate;
pub mod harness;
pub mod publisher;
pub mod responses;
pub mod rng;
pub mod server;
pub mod template;
pub mod tokenizer;
