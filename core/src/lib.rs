//! kvaffine's pure core: everything the filter and the daemon must agree on with vLLM,
//! byte for byte, and nothing that knows about Envoy, tokio or sockets.
//!
//! * [`keys`]: vLLM's prefix-cache block keys (`sha256_cbor`, `xxhash_cbor`), incremental.
//! * [`events`]: vLLM's KV-event batches (decode, encode) and their ZMQ framing.
//! * [`salt`]: `cache_salt` validation, as vLLM validates it.
//! * [`pick`]: the ranking policy, "sticky until saturated".
//! * [`request`]: OpenAI request bodies as vLLM's chat template receives them.
//! * [`config`]: the routing settings; [`api`]: which API a path is.
//! * [`plan`]: a buffered request to its next step; [`tokens`]: a tokenizer answer to
//!   block keys; [`approximate`]: text keys for the approximate mode.
//! * [`protocol`]: the lookup the filter asks and the daemon answers.
//! * [`reason`]: the one spelling of every routing outcome.
//! * [`outcome`]: what a replica says it served from cache, against the prediction.
//!
//! request body -> [`plan::plan`] -> (tokenize call -> [`tokens::keys_from_tokenize`]) ->
//! keys -> [`protocol::LookupRequest`] -> index -> [`protocol::Pick`] -> header values.
//!
//! The crate builds unchanged for `wasm32-wasip1` (the Envoy filter) and natively (the
//! daemon, the emulator, tests).
//!
//! ```
//! use kvaffine_core::{HashAlgo, KeyConfig, KeyExtras, VllmCompat};
//!
//! let config = KeyConfig::new(HashAlgo::Sha256Cbor, 16, None, VllmCompat::V0_31)?;
//! let mut chain = config.chain(&KeyExtras::default());
//! chain.extend(&[7; 40]);
//! assert_eq!(chain.keys().len(), 2); // two full blocks; 8 tokens wait for more
//! assert_eq!(chain.pending_tokens(), 8);
//! # Ok::<(), kvaffine_core::KeyConfigError>(())
//! ```

pub mod api;
pub mod approximate;
mod cbor;
pub mod config;
pub mod events;
pub mod keys;
pub mod outcome;
pub mod pick;
pub mod plan;
pub mod protocol;
pub mod reason;
pub mod request;
pub mod salt;
pub mod tokens;

pub use keys::{
    BlockKey, DEFAULT_NONE_HASH_SEED, Digest, DigestCache, HashAlgo, KeyChain, KeyConfig,
    KeyConfigError, KeyExtras, LoraAdapter, MAX_DIGEST_LEN, VllmCompat,
};
pub use pick::{Candidate, Demand, Load, PickPolicy, PrefillSpeed};
pub use reason::Reason;
pub use salt::{CacheSalt, CacheSaltError, MAX_CACHE_SALT_CHARS, salt_tag};
