//! vLLM's KV-cache events: the domain types, a tolerant decoder, a byte-exact encoder and
//! the ZMQ frame layouts that carry them.
//!
//! Wire facts (msgspec structs, map events since vLLM 0.24, positional before, u64 or
//! digest-bytes hashes) are in `../shared/reference/vllm-interfaces.md` §1 and pinned by
//! `../shared/vectors/kv_events.json` (see `core/tests/vectors.rs`).

mod decode;
mod encode;
mod frames;

pub use decode::{DecodeError, decode_batch};
pub use encode::{EventFormat, encode_batch};
pub use frames::{
    END_SEQ, EndpointError, FrameError, LiveMessage, ReplayMessage, live_frames,
    offset_endpoint_for_rank, parse_live, parse_replay, replay_end_frames, replay_frames,
    replay_request, start_seq_of_replay_request,
};

use crate::keys::{BlockKey, Digest};

/// One published batch: everything one scheduler step of one data-parallel rank produced.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// `time.time()` on the replica when the step ended; the daemon measures event lag from it.
    pub ts: f64,
    /// Events in the order the replica applied them.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published the batch (`None` before vLLM 0.9.2, or unset).
    pub data_parallel_rank: Option<i64>,
    /// Events of a type this decoder does not know, skipped so newer replicas keep working.
    pub skipped_unknown: u32,
}

/// A change to a replica's prefix cache.
// Nearly every event is a BlockStored, so boxing it would only add an allocation per event.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks became full and cached (during prefill and decode alike).
    BlockStored(BlockStored),
    /// Cached blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// A block hash as a replica publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// The default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the digest's last 8 bytes.
    /// Signed hashes of vLLM < 0.10.2 are normalised to their two's-complement `u64`.
    Int(u64),
    /// The full digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Digest(Digest),
}

impl EngineHash {
    /// The key the index stores: the same `u64` in both publishing modes.
    pub fn block_key(&self) -> BlockKey {
        match self {
            Self::Int(value) => BlockKey(*value),
            Self::Digest(digest) => digest.block_key(),
        }
    }
}

/// The msgpack bytes of one value this crate carries without interpreting, so that
/// decoding and re-encoding reproduces it exactly.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RawValue(pub Vec<u8>);

/// One item of a block's published extra keys.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// A bare string: the LoRA name (first, when the event has `lora_name`) or the cache salt.
    Text(String),
    /// Anything else (multimodal `[identifier, offset]`, prompt-embeds digests), kept verbatim.
    Other(RawValue),
}

/// `BlockStored` with every field of vLLM 0.33.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before the first stored one; `None` when they start at token 0.
    pub parent_block_hash: Option<EngineHash>,
    /// The tokens of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u64,
    /// Deprecated LoRA adapter id.
    pub lora_id: Option<i64>,
    /// Storage tier: `"GPU"` from vLLM's block pool, `"CPU"` etc. from offloading connectors.
    pub medium: Option<String>,
    /// LoRA adapter name (vLLM >= 0.14).
    pub lora_name: Option<String>,
    /// Per block: the untagged extra keys, or `None` (vLLM >= 0.17).
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV-cache group (vLLM >= 0.20).
    pub group_idx: Option<i64>,
    /// Attention kind of the group, e.g. `"full_attention"` (vLLM >= 0.22).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding-window size of the group (vLLM >= 0.22).
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// vLLM >= 0.26; carried verbatim.
    pub locality: Option<RawValue>,
    /// vLLM >= 0.29; carried verbatim.
    pub ownership: Option<RawValue>,
    /// vLLM >= 0.30; carried verbatim.
    pub session_id: Option<RawValue>,
    /// vLLM >= 0.33 (EAGLE lookahead hashing); carried verbatim.
    pub lookahead_token_ids: Option<RawValue>,
}

/// `BlockRemoved` with every field of vLLM 0.33.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    /// Hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier the blocks left.
    pub medium: Option<String>,
    /// KV-cache group (vLLM >= 0.20).
    pub group_idx: Option<i64>,
    /// vLLM >= 0.26; carried verbatim.
    pub locality: Option<RawValue>,
    /// vLLM >= 0.29; carried verbatim.
    pub ownership: Option<RawValue>,
}
