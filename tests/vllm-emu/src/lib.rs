//! vllm-emu: the parts of vLLM a KV-aware router can observe, reproduced exactly.
//!
//! * [`publisher`]: vLLM's `ZmqEventPublisher` (PUB stream, replay ROUTER, seq from 0).

pub mod publisher;
