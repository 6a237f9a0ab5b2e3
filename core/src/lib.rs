//! kvaffine's pure core: everything the filter and the daemon must agree on with vLLM,
//! byte for byte, and nothing that knows about Envoy, tokio or sockets.
//!
//! * [`keys`]: vLLM's prefix-cache block keys (`sha256_cbor`, `xxhash_cbor`), incremental.
//! * [`events`]: vLLM's KV-event batches (decode, encode) and their ZMQ framing.
//! * [`salt`]: `cache_salt` validation, as vLLM validates it.
//! * [`pick`]: the ranking policy, "sticky until saturated".
//! * [`request`]: OpenAI request bodies as vLLM's chat template receives them.
//! * [`route`]: a buffered request to the index question, the answer to a pick.
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

mod cbor;
pub mod events;
pub mod keys;
pub mod pick;
pub mod request;
pub mod route;
pub mod salt;

pub use keys::{
    BlockKey, DEFAULT_NONE_HASH_SEED, Digest, DigestCache, HashAlgo, KeyChain, KeyConfig,
    KeyConfigError, KeyExtras, LoraAdapter, MAX_DIGEST_LEN, VllmCompat,
};
pub use pick::{Candidate, Load, PickPolicy, PickReason};
pub use salt::{CacheSalt, CacheSaltError, MAX_CACHE_SALT_CHARS};
