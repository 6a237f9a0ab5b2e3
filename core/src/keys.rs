//! vLLM's prefix-cache block keys, computed byte for byte as vLLM computes them.
//!
//! vLLM (>= 0.31, `--prefix-caching-hash-algo sha256_cbor` or `xxhash_cbor`) keys block `i`
//! of a request as `H(cbor([parent, tokens_of_block_i, extra_keys_i or null]))`, where the
//! parent is the previous block's full digest and block 0's parent is `NONE_HASH = H(seed)`.
//! Only full blocks are keyed. KV events carry the last 8 bytes of each digest as a
//! big-endian `u64`, the [`BlockKey`]. Every rule here is pinned by the golden vectors in
//! `../shared/vectors/block_hashes.json` (see `core/tests/vectors.rs`).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::cbor;
use crate::salt::CacheSalt;

/// The longest digest any supported algorithm produces (SHA-256).
pub const MAX_DIGEST_LEN: usize = 32;

/// vLLM's `NONE_HASH` seed when `PYTHONHASHSEED` is unset (vLLM >= 0.29, sha256 algorithms).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// A full block digest: what vLLM chains from block to block.
///
/// Stored inline (no allocation) because a request has one per block.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest {
    bytes: [u8; MAX_DIGEST_LEN],
    len: u8,
}

impl Digest {
    /// Wraps digest bytes as published in KV events with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
    /// Returns `None` for an empty or over-long slice.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() || bytes.len() > MAX_DIGEST_LEN {
            return None;
        }
        let mut out = [0u8; MAX_DIGEST_LEN];
        out.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(Self {
            bytes: out,
            len: bytes.len() as u8,
        })
    }

    /// The digest bytes, as vLLM feeds them to the next block's preimage.
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or(&[])
    }

    /// The event form: `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last 8 bytes.
    pub fn block_key(&self) -> BlockKey {
        let bytes = self.as_bytes();
        let tail = bytes.get(bytes.len().saturating_sub(8)..).unwrap_or(&[]);
        BlockKey(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// Lower-case hex, the form operators compare against vLLM logs and the vectors.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(self.as_bytes().len() * 2);
        for b in self.as_bytes() {
            for nibble in [b >> 4, b & 0x0f] {
                s.extend(char::from_digit(u32::from(nibble), 16));
            }
        }
        s
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

/// The key a KV event publishes for a block, and the key the index is built on.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The hash algorithms a router can reproduce: vLLM's two CBOR-based ones.
///
/// vLLM's default `sha256` and `xxhash` hash a Python pickle, which no router can
/// reproduce robustly; the daemon re-keys such replicas from their events instead.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum HashAlgo {
    /// `--prefix-caching-hash-algo sha256_cbor`: SHA-256 of canonical CBOR, 32-byte digests.
    #[default]
    Sha256Cbor,
    /// `--prefix-caching-hash-algo xxhash_cbor`: XXH3-128 of canonical CBOR, 16-byte digests.
    XxhashCbor,
}

impl HashAlgo {
    /// The name vLLM uses on its command line and in `vllm:cache_config_info`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sha256Cbor => "sha256_cbor",
            Self::XxhashCbor => "xxhash_cbor",
        }
    }

    fn digest_len(self) -> usize {
        match self {
            Self::Sha256Cbor => 32,
            Self::XxhashCbor => 16,
        }
    }

    fn hash(self, preimage: &[u8]) -> Digest {
        let mut bytes = [0u8; MAX_DIGEST_LEN];
        let len = match self {
            Self::Sha256Cbor => {
                bytes.copy_from_slice(&Sha256::digest(preimage));
                32
            }
            Self::XxhashCbor => {
                let value = xxhash_rust::xxh3::xxh3_128(preimage).to_be_bytes();
                if let Some(head) = bytes.get_mut(..16) {
                    head.copy_from_slice(&value);
                }
                16
            }
        };
        Digest { bytes, len }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = KeyConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256_cbor" => Ok(Self::Sha256Cbor),
            "xxhash_cbor" => Ok(Self::XxhashCbor),
            "sha256" | "xxhash" => Err(KeyConfigError::PickleAlgo(s.to_owned())),
            other => Err(KeyConfigError::UnknownAlgo(other.to_owned())),
        }
    }
}

/// Which vLLM generation's extra-key encoding to reproduce.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum VllmCompat {
    /// vLLM 0.29 and 0.30 (and, with a seed set, back to 0.11.2): bare extra keys,
    /// `lora_name` then `salt`. A LoRA named X collides with a salt X (vLLM issue #44701).
    V0_30,
    /// vLLM >= 0.31: tagged extra keys, `("lora", name, path)` then `("cache_salt", salt)`.
    #[default]
    V0_31,
}

impl VllmCompat {
    /// The spelling `--vllm-compat` and the filter's `vllm_compat` take.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V0_30 => "0.30",
            Self::V0_31 => "0.31",
        }
    }
}

impl FromStr for VllmCompat {
    type Err = KeyConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "0.30" => Ok(Self::V0_30),
            "0.31" => Ok(Self::V0_31),
            other => Err(KeyConfigError::UnknownCompat(other.to_owned())),
        }
    }
}

/// Why a key configuration cannot reproduce vLLM's keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyConfigError {
    /// A block holds at least one token.
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    /// vLLM seeds `xxhash_cbor` randomly per process unless `PYTHONHASHSEED` is set.
    #[error(
        "xxhash_cbor needs a hash seed: without PYTHONHASHSEED vLLM picks a random one per process"
    )]
    XxhashNeedsSeed,
    /// The pickle-based algorithms cannot be reproduced outside CPython.
    #[error(
        "hash algorithm {0:?} hashes a Python pickle and cannot be reproduced; run vLLM with --prefix-caching-hash-algo sha256_cbor"
    )]
    PickleAlgo(String),
    /// Not a vLLM algorithm name.
    #[error("unknown hash algorithm {0:?} (expected sha256_cbor or xxhash_cbor)")]
    UnknownAlgo(String),
    /// Not a supported compatibility level.
    #[error("unknown vLLM compatibility {0:?} (expected 0.30 or 0.31)")]
    UnknownCompat(String),
}

/// A LoRA adapter as vLLM keys it: by name and, since 0.31, by path.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LoraAdapter {
    /// `lora_name` of the request's LoRA.
    pub name: String,
    /// `lora_path` as the replica loaded it (vLLM >= 0.31 hashes it).
    pub path: String,
}

/// What besides tokens enters a request's keys.
///
/// Multimodal (`("mm", id, offset)`) and prompt-embeds keys vary per block; they would
/// join here as per-block items when routing them is supported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyExtras {
    /// The request's LoRA adapter, keyed into every block.
    pub lora: Option<LoraAdapter>,
    /// The request's `cache_salt`, keyed into block 0 only.
    pub cache_salt: Option<CacheSalt>,
}

/// Everything that must match the replica's settings for keys to match: algorithm,
/// block size, seed and extra-key encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyConfig {
    algo: HashAlgo,
    block_size: usize,
    compat: VllmCompat,
    none_hash: Digest,
}

impl KeyConfig {
    /// Builds the configuration of a replica that runs with `algo`, `--block-size block_size`
    /// and `PYTHONHASHSEED=hash_seed` (`None`: unset).
    pub fn new(
        algo: HashAlgo,
        block_size: usize,
        hash_seed: Option<&str>,
        compat: VllmCompat,
    ) -> Result<Self, KeyConfigError> {
        if block_size == 0 {
            return Err(KeyConfigError::ZeroBlockSize);
        }
        let seed = match (hash_seed, algo) {
            (Some(seed), _) => seed,
            (None, HashAlgo::Sha256Cbor) => DEFAULT_NONE_HASH_SEED,
            (None, HashAlgo::XxhashCbor) => return Err(KeyConfigError::XxhashNeedsSeed),
        };
        let mut preimage = Vec::with_capacity(seed.len() + 9);
        cbor::write_text(&mut preimage, seed);
        Ok(Self {
            algo,
            block_size,
            compat,
            none_hash: algo.hash(&preimage),
        })
    }

    /// The hash algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The extra-key encoding in use.
    pub fn compat(&self) -> VllmCompat {
        self.compat
    }

    /// `NONE_HASH`, the parent of block 0.
    pub fn none_hash(&self) -> Digest {
        self.none_hash
    }

    /// Starts the keys of a request at its first token.
    pub fn chain(&self, extras: &KeyExtras) -> KeyChain {
        KeyChain::new(self, extras, self.none_hash, true)
    }

    /// Continues the keys of a request whose last full block has digest `parent`; the
    /// next block is not block 0, so the salt does not enter it.
    pub fn chain_after(&self, extras: &KeyExtras, parent: Digest) -> KeyChain {
        KeyChain::new(self, extras, parent, false)
    }

    /// The digests of every full block of `tokens`, in order.
    pub fn digests(&self, extras: &KeyExtras, tokens: &[u32]) -> Vec<Digest> {
        let mut chain = self.chain(extras);
        chain.extend(tokens);
        chain.into_digests()
    }

    fn encode_extras(&self, extras: &KeyExtras, first_block: bool, out: &mut Vec<u8>) {
        let salt = extras.cache_salt.as_ref().filter(|_| first_block);
        let count = usize::from(extras.lora.is_some()) + usize::from(salt.is_some());
        if count == 0 {
            out.push(cbor::NULL);
            return;
        }
        cbor::write_array_head(out, count);
        match self.compat {
            VllmCompat::V0_31 => {
                if let Some(lora) = &extras.lora {
                    cbor::write_array_head(out, 3);
                    cbor::write_text(out, "lora");
                    cbor::write_text(out, &lora.name);
                    cbor::write_text(out, &lora.path);
                }
                if let Some(salt) = salt {
                    cbor::write_array_head(out, 2);
                    cbor::write_text(out, "cache_salt");
                    cbor::write_text(out, salt.as_str());
                }
            }
            VllmCompat::V0_30 => {
                if let Some(lora) = &extras.lora {
                    cbor::write_text(out, &lora.name);
                }
                if let Some(salt) = salt {
                    cbor::write_text(out, salt.as_str());
                }
            }
        }
    }
}

/// The keys of one request, extended incrementally: appending tokens hashes only the
/// blocks they complete, never the prefix again.
#[derive(Clone, Debug)]
pub struct KeyChain {
    algo: HashAlgo,
    block_size: usize,
    /// CBOR of block 0's extra keys (LoRA and salt), or `null`.
    first_extras: Vec<u8>,
    /// CBOR of every later block's extra keys (LoRA only), or `null`.
    rest_extras: Vec<u8>,
    at_first_block: bool,
    parent: Digest,
    /// Tokens of the trailing partial block, which vLLM does not key yet.
    pending: Vec<u32>,
    digests: Vec<Digest>,
    /// The preimage buffer, reused for every block.
    scratch: Vec<u8>,
}

impl KeyChain {
    fn new(config: &KeyConfig, extras: &KeyExtras, parent: Digest, at_first_block: bool) -> Self {
        let mut first_extras = Vec::new();
        config.encode_extras(extras, true, &mut first_extras);
        let mut rest_extras = Vec::new();
        config.encode_extras(extras, false, &mut rest_extras);
        let block_size = config.block_size;
        // Worst case per block: 3 bytes of array and parent heads, the digest, a 9-byte
        // array head, 5 bytes per token, the extra keys.
        let scratch_len = 12 + MAX_DIGEST_LEN + 5 * block_size + first_extras.len();
        Self {
            algo: config.algo,
            block_size,
            first_extras,
            rest_extras,
            at_first_block,
            parent,
            pending: Vec::with_capacity(block_size),
            digests: Vec::new(),
            scratch: Vec::with_capacity(scratch_len),
        }
    }

    /// Appends tokens and keys every block they complete.
    pub fn extend(&mut self, tokens: &[u32]) {
        self.extend_with(tokens, &mut None);
    }

    /// As [`Self::extend`], reusing digests of blocks seen before: a conversation's next
    /// turn hashes only its new blocks. The cache is keyed by a keyed XXH3-128 of the whole
    /// preimage (parent, tokens, extra keys), so only an identical block can hit.
    pub fn extend_cached(&mut self, tokens: &[u32], cache: &mut DigestCache) {
        let mut cache = Some(cache);
        self.extend_with(tokens, &mut cache);
    }

    fn extend_with(&mut self, tokens: &[u32], cache: &mut Option<&mut DigestCache>) {
        self.digests
            .reserve((self.pending.len() + tokens.len()) / self.block_size);
        let mut rest = tokens;
        if !self.pending.is_empty() {
            let missing = self.block_size - self.pending.len();
            let (fill, after) = rest.split_at(missing.min(rest.len()));
            self.pending.extend_from_slice(fill);
            rest = after;
            if self.pending.len() == self.block_size {
                let block = std::mem::take(&mut self.pending);
                self.push_block(&block, cache);
                self.pending = block;
                self.pending.clear();
            }
        }
        let blocks = rest.chunks_exact(self.block_size);
        let tail = blocks.remainder();
        for block in blocks {
            self.push_block(block, cache);
        }
        self.pending.extend_from_slice(tail);
    }

    fn push_block(&mut self, tokens: &[u32], cache: &mut Option<&mut DigestCache>) {
        let scratch = &mut self.scratch;
        scratch.clear();
        cbor::write_array_head(scratch, 3);
        cbor::write_bytes(scratch, self.parent.as_bytes());
        cbor::write_array_head(scratch, tokens.len());
        for &token in tokens {
            cbor::write_uint(scratch, u64::from(token));
        }
        let extras = if self.at_first_block {
            &self.first_extras
        } else {
            &self.rest_extras
        };
        scratch.extend_from_slice(extras);
        let digest = match cache {
            Some(cache) => {
                let fingerprint = cache.fingerprint(self.algo, scratch);
                match cache.get(fingerprint) {
                    Some(digest) => digest,
                    None => {
                        let digest = self.algo.hash(scratch);
                        cache.insert(fingerprint, digest);
                        digest
                    }
                }
            }
            None => self.algo.hash(scratch),
        };
        debug_assert_eq!(digest.as_bytes().len(), self.algo.digest_len());
        self.digests.push(digest);
        self.parent = digest;
        self.at_first_block = false;
    }

    /// Full digests of the keyed blocks, in order.
    pub fn digests(&self) -> &[Digest] {
        &self.digests
    }

    /// Event-form keys of the keyed blocks, in order: what the index is asked about.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = BlockKey> + '_ {
        self.digests.iter().map(Digest::block_key)
    }

    /// Tokens past the last full block: vLLM has no key for them yet.
    pub fn pending_tokens(&self) -> usize {
        self.pending.len()
    }

    /// Gives up the digests without copying them.
    pub fn into_digests(self) -> Vec<Digest> {
        self.digests
    }
}

/// A hasher for keys that are already uniform random bits (fingerprints).
#[derive(Default)]
struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

type Fingerprints = HashMap<u128, Digest, BuildHasherDefault<FingerprintHasher>>;

/// Recently computed block digests, bounded: two generations of at most `capacity / 2`
/// entries each; when the newer fills, the older is dropped. Hits move to the newer.
///
/// A conversation resends its whole history every turn; with this cache only the blocks
/// the new turn adds are hashed with SHA-256 (figures in docs/benchmarks/filter.md).
#[derive(Debug)]
pub struct DigestCache {
    current: Fingerprints,
    previous: Fingerprints,
    capacity: usize,
    secret: u64,
}

impl DigestCache {
    /// A cache of about `capacity` digests. `secret` keys the fingerprints, so nobody who
    /// does not know it can craft a block that collides with another's.
    pub fn new(capacity: usize, secret: u64) -> Self {
        Self {
            current: Fingerprints::default(),
            previous: Fingerprints::default(),
            capacity: capacity.max(2),
            secret,
        }
    }

    fn fingerprint(&self, algo: HashAlgo, preimage: &[u8]) -> u128 {
        let seed = self.secret ^ (algo as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        xxhash_rust::xxh3::xxh3_128_with_seed(preimage, seed)
    }

    fn get(&mut self, fingerprint: u128) -> Option<Digest> {
        if let Some(digest) = self.current.get(&fingerprint) {
            return Some(*digest);
        }
        let digest = self.previous.remove(&fingerprint)?;
        self.insert(fingerprint, digest);
        Some(digest)
    }

    fn insert(&mut self, fingerprint: u128, digest: Digest) {
        if self.current.len() >= self.capacity / 2 {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(fingerprint, digest);
    }

    /// Digests held.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha() -> KeyConfig {
        KeyConfig::new(HashAlgo::Sha256Cbor, 4, None, VllmCompat::V0_31).unwrap()
    }

    #[test]
    fn none_hash_matches_vllm_for_the_default_and_a_set_seed() {
        assert_eq!(
            sha().none_hash().to_hex(),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        let seeded = KeyConfig::new(HashAlgo::Sha256Cbor, 4, Some("0"), VllmCompat::V0_31);
        assert_eq!(
            seeded.unwrap().none_hash().to_hex(),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
    }

    #[test]
    fn rejects_configurations_vllm_keys_cannot_match() {
        let zero = KeyConfig::new(HashAlgo::Sha256Cbor, 0, None, VllmCompat::V0_31);
        assert_eq!(zero, Err(KeyConfigError::ZeroBlockSize));
        let xx = KeyConfig::new(HashAlgo::XxhashCbor, 16, None, VllmCompat::V0_31);
        assert_eq!(xx, Err(KeyConfigError::XxhashNeedsSeed));
        assert!(matches!(
            "sha256".parse::<HashAlgo>(),
            Err(KeyConfigError::PickleAlgo(_))
        ));
    }

    #[test]
    fn event_key_is_the_last_eight_bytes_big_endian() {
        let bytes: Vec<u8> = (0u8..32).collect();
        let digest = Digest::from_slice(&bytes).unwrap();
        assert_eq!(digest.block_key(), BlockKey(0x18191a1b1c1d1e1f));
        let short = Digest::from_slice(&[1, 2]).unwrap();
        assert_eq!(short.block_key(), BlockKey(0x0102));
        assert!(Digest::from_slice(&[0; 33]).is_none());
    }

    #[test]
    fn only_full_blocks_are_keyed() {
        let config = sha();
        assert_eq!(config.digests(&KeyExtras::default(), &[1, 2, 3]).len(), 0);
        assert_eq!(config.digests(&KeyExtras::default(), &[1; 11]).len(), 2);
    }

    #[test]
    fn extending_in_any_split_gives_the_same_keys() {
        let config = sha();
        let extras = KeyExtras {
            cache_salt: Some(CacheSalt::parse("t").unwrap()),
            ..KeyExtras::default()
        };
        let tokens: Vec<u32> = (0..23).map(|i| i * 7919).collect();
        let whole = config.digests(&extras, &tokens);
        for split in 0..tokens.len() {
            let mut chain = config.chain(&extras);
            chain.extend(&tokens[..split]);
            chain.extend(&tokens[split..]);
            assert_eq!(chain.digests(), whole.as_slice(), "split at {split}");
            assert_eq!(chain.pending_tokens(), 3);
        }
    }

    #[test]
    fn cached_keys_equal_uncached_keys_and_stay_bounded() {
        let config = sha();
        let mut cache = DigestCache::new(8, 42);
        for salt in ["a", "b", "a"] {
            let extras = KeyExtras {
                cache_salt: Some(CacheSalt::parse(salt).unwrap()),
                ..KeyExtras::default()
            };
            for len in [5usize, 16, 29] {
                let tokens: Vec<u32> = (0..len as u32).map(|t| t * 31).collect();
                let mut chain = config.chain(&extras);
                chain.extend_cached(&tokens, &mut cache);
                assert_eq!(chain.digests(), config.digests(&extras, &tokens).as_slice());
                assert!(cache.len() <= 8);
            }
        }
        let xx = KeyConfig::new(HashAlgo::XxhashCbor, 4, Some("0"), VllmCompat::V0_31).unwrap();
        let mut chain = xx.chain(&KeyExtras::default());
        chain.extend_cached(&[1, 2, 3, 4], &mut cache);
        assert_eq!(
            chain.digests(),
            xx.digests(&KeyExtras::default(), &[1, 2, 3, 4]).as_slice()
        );
    }

    #[test]
    fn a_chain_resumed_after_a_parent_continues_it() {
        let config = sha();
        let extras = KeyExtras {
            cache_salt: Some(CacheSalt::parse("t").unwrap()),
            ..KeyExtras::default()
        };
        let tokens: Vec<u32> = (0..16).collect();
        let whole = config.digests(&extras, &tokens);
        let mut tail = config.chain_after(&extras, whole[1]);
        tail.extend(&tokens[8..]);
        assert_eq!(tail.digests(), &whole[2..]);
    }

    #[test]
    fn salts_change_every_key_and_only_through_block_zero() {
        let config = sha();
        let tokens: Vec<u32> = (0..12).collect();
        let salted = |s: &str| KeyExtras {
            cache_salt: Some(CacheSalt::parse(s).unwrap()),
            ..KeyExtras::default()
        };
        let a = config.digests(&salted("a"), &tokens);
        let b = config.digests(&salted("b"), &tokens);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let after = config.chain_after(&salted("a"), a[0]);
        let mut unsalted_after = config.chain_after(&KeyExtras::default(), a[0]);
        let mut salted_after = after;
        salted_after.extend(&tokens[4..]);
        unsalted_after.extend(&tokens[4..]);
        assert_eq!(salted_after.digests(), unsalted_after.digests());
    }
}
