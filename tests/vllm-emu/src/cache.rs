//! The prefix cache of one replica, as vLLM's block pool behaves where a router can see it:
//! full blocks are cached under their keys, requests reference them, unreferenced cached
//! blocks are evicted least recently used first (a request's tail before its head), and
//! every change becomes a KV event.

use std::collections::{BTreeMap, HashMap};

use kvaffine_core::events::{BlockRemoved, BlockStored, EngineHash, ExtraKey, KvEvent};
use kvaffine_core::{Digest, KeyExtras};

/// What replicas publish as a block's hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineHashMode {
    /// The key's event form, as vLLM with `sha256_cbor` publishes.
    Keys,
    /// Another deterministic function of the block, standing in for vLLM's default
    /// pickle-based `sha256` that no router can reproduce.
    Opaque,
}

impl EngineHashMode {
    /// The published hash of a block with digest `digest`.
    pub fn hash(self, digest: &Digest) -> u64 {
        match self {
            Self::Keys => digest.block_key().0,
            Self::Opaque => xxhash_rust::xxh3::xxh3_64(digest.as_bytes()),
        }
    }
}

struct Block {
    refs: u32,
    /// Position in the eviction order while unreferenced.
    free_tick: Option<u64>,
}

/// Blocks held for one running request.
#[derive(Debug, Default)]
pub struct Holding {
    /// Digests of its cached blocks, in order.
    pub blocks: Vec<Digest>,
    /// Whether it also holds one partial (uncached) block.
    pub partial: bool,
    /// Blocks allocated for its prefill and not yet cached.
    pub reserved: usize,
}

/// Not enough unreferenced blocks to admit a request now.
#[derive(Debug, PartialEq, Eq)]
pub struct NoCapacity;

/// One replica's KV-cache blocks.
pub struct PrefixCache {
    capacity: usize,
    block_size: usize,
    mode: EngineHashMode,
    blocks: HashMap<Digest, Block>,
    /// Unreferenced cached blocks by the tick they were freed: evicted lowest first.
    free: BTreeMap<u64, Digest>,
    tick: u64,
    /// Partial blocks held by running requests (they take capacity but are not cached).
    partials: usize,
    /// Blocks of admitted prompts still being prefilled: allocated, not yet cached.
    reserved: usize,
    events: Vec<KvEvent>,
}

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_size` tokens.
    pub fn new(capacity: usize, block_size: usize, mode: EngineHashMode) -> Self {
        Self {
            capacity,
            block_size,
            mode,
            blocks: HashMap::new(),
            free: BTreeMap::new(),
            tick: 0,
            partials: 0,
            reserved: 0,
            events: Vec::new(),
        }
    }

    /// Fraction of blocks in use or cached (`vllm:kv_cache_usage_perc` counts blocks held by
    /// requests; cached free blocks are reusable, so they do not count).
    pub fn usage(&self) -> f64 {
        let held = self.blocks.len() - self.free.len() + self.partials + self.reserved;
        held as f64 / self.capacity.max(1) as f64
    }

    /// Events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Leading blocks of `digests` that are cached.
    pub fn cached_prefix(&self, digests: &[Digest]) -> usize {
        digests
            .iter()
            .take_while(|d| self.blocks.contains_key(d))
            .count()
    }

    fn in_use(&self) -> usize {
        self.blocks.len() + self.partials + self.reserved
    }

    fn evict_one(&mut self, keep: &[Digest]) -> bool {
        let victim = self
            .free
            .iter()
            .find(|(_, d)| !keep.contains(d))
            .map(|(t, d)| (*t, *d));
        let Some((tick, digest)) = victim else {
            return false;
        };
        self.free.remove(&tick);
        self.blocks.remove(&digest);
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash::Int(self.mode.hash(&digest))],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..BlockRemoved::default()
        }));
        true
    }

    fn reference(&mut self, digest: &Digest) {
        if let Some(block) = self.blocks.get_mut(digest) {
            if block.refs == 0 {
                if let Some(tick) = block.free_tick.take() {
                    self.free.remove(&tick);
                }
            }
            block.refs += 1;
        }
    }

    /// Admits a prompt: references its cached prefix (at most `hit_cap` blocks) and
    /// allocates its other full blocks plus a partial one (the first generated token needs
    /// one anyway). The new blocks become cached, and are reported, only when the prefill
    /// that computes them is done ([`Self::commit_prefill`]), as in vLLM. Returns the
    /// blocks used from the cache.
    pub fn admit(
        &mut self,
        digests: &[Digest],
        hit_cap: usize,
        holding: &mut Holding,
    ) -> Result<usize, NoCapacity> {
        let hits = self.cached_prefix(digests).min(hit_cap);
        let new_blocks = digests.len() - hits;
        let need = new_blocks + 1;
        let keep = digests.get(..hits).unwrap_or(&[]);
        while self.capacity.saturating_sub(self.in_use()) < need {
            if !self.evict_one(keep) {
                return Err(NoCapacity);
            }
        }
        for digest in keep {
            self.reference(digest);
        }
        holding.blocks.extend_from_slice(keep);
        holding.reserved = new_blocks;
        self.reserved += new_blocks;
        self.partials += 1;
        holding.partial = true;
        Ok(hits)
    }

    /// An admitted prompt is about to be prefilled: blocks of its prefix cached since its
    /// admission (a request ahead of it computed them) are used instead of recomputed, as
    /// vLLM's scheduler looks a waiting request's prefix up when it schedules it. Returns
    /// the further blocks used from the cache.
    pub fn adopt_cached(
        &mut self,
        digests: &[Digest],
        hit_cap: usize,
        holding: &mut Holding,
    ) -> usize {
        let from = holding.blocks.len();
        let mut adopted = 0;
        for digest in digests.iter().take(hit_cap).skip(from) {
            if holding.reserved == 0 || !self.blocks.contains_key(digest) {
                break;
            }
            self.reference(digest);
            holding.blocks.push(*digest);
            holding.reserved -= 1;
            self.reserved -= 1;
            adopted += 1;
        }
        adopted
    }

    /// The prefill of an admitted prompt finished: its new full blocks are cached now.
    pub fn commit_prefill(
        &mut self,
        tokens: &[u32],
        digests: &[Digest],
        extras: &KeyExtras,
        holding: &mut Holding,
    ) {
        self.reserved -= holding.reserved;
        holding.reserved = 0;
        let from = holding.blocks.len();
        self.store(tokens, digests, from, extras, holding);
    }

    /// Caches the full blocks `digests[from..]` of `tokens`, held by `holding`.
    fn store(
        &mut self,
        tokens: &[u32],
        digests: &[Digest],
        from: usize,
        extras: &KeyExtras,
        holding: &mut Holding,
    ) {
        let mut stored = Vec::new();
        for (i, digest) in digests.iter().enumerate().skip(from) {
            match self.blocks.get_mut(digest) {
                Some(_) => self.reference(digest),
                None => {
                    self.blocks.insert(
                        *digest,
                        Block {
                            refs: 1,
                            free_tick: None,
                        },
                    );
                    stored.push(i);
                }
            }
            holding.blocks.push(*digest);
        }
        let (Some(&first), Some(&last)) = (stored.first(), stored.last()) else {
            return;
        };
        // One event per contiguous run, as vLLM reports each cache_full_blocks call.
        let block_size = self.block_size;
        let event_extras = |i: usize| -> Option<Vec<ExtraKey>> {
            let mut keys = Vec::new();
            if let Some(lora) = &extras.lora {
                keys.push(ExtraKey::Text(lora.name.clone()));
            }
            if let (0, Some(salt)) = (i, &extras.cache_salt) {
                keys.push(ExtraKey::Text(salt.as_str().to_owned()));
            }
            (!keys.is_empty()).then_some(keys)
        };
        let mut run_start = first;
        for (n, &i) in stored.iter().enumerate() {
            let run_ends = stored.get(n + 1).is_none_or(|&next| next != i + 1);
            if !run_ends {
                continue;
            }
            let range = run_start..=i;
            self.events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: range
                    .clone()
                    .filter_map(|b| digests.get(b))
                    .map(|d| EngineHash::Int(self.mode.hash(d)))
                    .collect(),
                parent_block_hash: run_start
                    .checked_sub(1)
                    .and_then(|p| digests.get(p))
                    .map(|d| EngineHash::Int(self.mode.hash(d))),
                token_ids: tokens
                    .get(run_start * block_size..(i + 1) * block_size)
                    .unwrap_or(&[])
                    .to_vec(),
                block_size: block_size as u64,
                lora_id: extras.lora.as_ref().map(|_| 1),
                medium: Some("GPU".into()),
                lora_name: extras.lora.as_ref().map(|l| l.name.clone()),
                extra_keys: Some(range.map(event_extras).collect()),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..BlockStored::default()
            }));
            if let Some(&next) = stored.get(n + 1) {
                run_start = next;
            }
        }
        debug_assert!(last >= first);
    }

    /// Generation filled more blocks: cache `digests[held..]` (the request's whole token
    /// list is `tokens`). Blocks that cannot be allocated are simply not cached.
    pub fn extend(
        &mut self,
        tokens: &[u32],
        digests: &[Digest],
        extras: &KeyExtras,
        holding: &mut Holding,
    ) {
        let held = holding.blocks.len();
        let mut until = held;
        while until < digests.len() {
            // The partial block the request holds becomes this full block; the next
            // partial needs a fresh one.
            if self.capacity.saturating_sub(self.in_use()) == 0
                && !self.evict_one(digests.get(..until).unwrap_or(&[]))
            {
                break;
            }
            until += 1;
        }
        let truncated = digests.get(..until).unwrap_or(&[]);
        self.store(tokens, truncated, held, extras, holding);
    }

    /// The request finished: its blocks become evictable, tail first.
    pub fn release(&mut self, holding: Holding) {
        self.reserved -= holding.reserved;
        if holding.partial {
            self.partials = self.partials.saturating_sub(1);
        }
        for digest in holding.blocks.iter().rev() {
            if let Some(block) = self.blocks.get_mut(digest) {
                block.refs = block.refs.saturating_sub(1);
                if block.refs == 0 && block.free_tick.is_none() {
                    self.tick += 1;
                    block.free_tick = Some(self.tick);
                    self.free.insert(self.tick, *digest);
                }
            }
        }
    }

    /// Drops every cached block (`POST /reset_prefix_cache`); refused while requests run,
    /// as vLLM refuses.
    pub fn reset(&mut self) -> bool {
        if self.blocks.len() != self.free.len() || self.partials != 0 || self.reserved != 0 {
            return false;
        }
        self.blocks.clear();
        self.free.clear();
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvaffine_core::{CacheSalt, HashAlgo, KeyConfig, VllmCompat};

    fn config() -> KeyConfig {
        KeyConfig::new(HashAlgo::Sha256Cbor, 4, None, VllmCompat::V0_31).unwrap()
    }

    fn stored_hashes(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some(
                    s.block_hashes
                        .iter()
                        .map(|h| h.block_key().0)
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn a_second_request_hits_the_first_ones_blocks_and_events_say_so() {
        let keys = config();
        let extras = KeyExtras::default();
        let mut cache = PrefixCache::new(100, 4, EngineHashMode::Keys);
        let tokens: Vec<u32> = (0..10).collect();
        let digests = keys.digests(&extras, &tokens);
        let mut first = Holding::default();
        assert_eq!(cache.admit(&digests, usize::MAX, &mut first), Ok(0));
        assert!(
            cache.take_events().is_empty(),
            "nothing is cached before the prefill ran"
        );
        assert_eq!(cache.cached_prefix(&digests), 0);
        cache.commit_prefill(&tokens, &digests, &extras, &mut first);
        let events = cache.take_events();
        assert_eq!(
            stored_hashes(&events),
            digests.iter().map(|d| d.block_key().0).collect::<Vec<_>>()
        );
        cache.release(first);
        let mut second = Holding::default();
        assert_eq!(cache.admit(&digests, usize::MAX, &mut second), Ok(2));
        assert!(
            cache.take_events().is_empty(),
            "hits are not reported again"
        );
    }

    #[test]
    fn a_request_admitted_during_anothers_prefill_adopts_its_blocks_when_scheduled() {
        let keys = config();
        let extras = KeyExtras::default();
        let mut cache = PrefixCache::new(100, 4, EngineHashMode::Keys);
        let tokens: Vec<u32> = (0..10).collect();
        let digests = keys.digests(&extras, &tokens);
        let (mut first, mut second) = (Holding::default(), Holding::default());
        assert_eq!(cache.admit(&digests, usize::MAX, &mut first), Ok(0));
        assert_eq!(cache.admit(&digests, 2, &mut second), Ok(0));
        assert_eq!(cache.adopt_cached(&digests, 2, &mut second), 0);
        cache.commit_prefill(&tokens, &digests, &extras, &mut first);
        // Two full blocks cached; the hit cap (the last token is recomputed) is 2.
        assert_eq!(cache.adopt_cached(&digests, 2, &mut second), 2);
        assert_eq!(second.reserved, 0);
        cache.commit_prefill(&tokens, &digests, &extras, &mut second);
        assert!(
            cache.take_events().len() <= 1,
            "the second prefill stores nothing new"
        );
        cache.release(first);
        cache.release(second);
        assert_eq!(cache.in_use(), cache.cached_prefix(&digests));
    }

    #[test]
    fn eviction_removes_the_least_recently_freed_tail_first() {
        let keys = config();
        let extras = KeyExtras::default();
        let mut cache = PrefixCache::new(3, 4, EngineHashMode::Keys);
        let a: Vec<u32> = (0..8).collect();
        let da = keys.digests(&extras, &a);
        let mut h = Holding::default();
        cache.admit(&da, usize::MAX, &mut h).unwrap();
        cache.commit_prefill(&a, &da, &extras, &mut h);
        cache.release(h);
        cache.take_events();
        let b: Vec<u32> = (100..104).collect();
        let db = keys.digests(&extras, &b);
        let mut h = Holding::default();
        cache.admit(&db, usize::MAX, &mut h).unwrap();
        cache.commit_prefill(&b, &db, &extras, &mut h);
        let events = cache.take_events();
        let removed: Vec<u64> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.block_hashes[0].block_key().0),
                _ => None,
            })
            .collect();
        assert_eq!(removed, vec![da[1].block_key().0], "a's tail goes first");
        assert_eq!(cache.cached_prefix(&da), 1);
    }

    #[test]
    fn a_full_cache_of_running_requests_refuses_admission() {
        let keys = config();
        let extras = KeyExtras::default();
        let mut cache = PrefixCache::new(2, 4, EngineHashMode::Keys);
        let a: Vec<u32> = (0..4).collect();
        let mut h = Holding::default();
        let da = keys.digests(&extras, &a);
        cache.admit(&da, usize::MAX, &mut h).unwrap();
        cache.commit_prefill(&a, &da, &extras, &mut h);
        let b: Vec<u32> = (9..13).collect();
        let mut h2 = Holding::default();
        assert_eq!(
            cache.admit(&keys.digests(&extras, &b), usize::MAX, &mut h2),
            Err(NoCapacity)
        );
        assert!(!cache.reset(), "reset refused while a request runs");
        cache.release(h);
        assert!(cache.reset());
        assert_eq!(cache.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    }

    #[test]
    fn the_salt_is_published_bare_on_block_zero_only() {
        let keys = config();
        let extras = KeyExtras {
            cache_salt: Some(CacheSalt::parse("t").unwrap()),
            ..KeyExtras::default()
        };
        let mut cache = PrefixCache::new(10, 4, EngineHashMode::Opaque);
        let tokens: Vec<u32> = (0..8).collect();
        let digests = keys.digests(&extras, &tokens);
        let mut h = Holding::default();
        cache.admit(&digests, usize::MAX, &mut h).unwrap();
        cache.commit_prefill(&tokens, &digests, &extras, &mut h);
        let events = cache.take_events();
        let KvEvent::BlockStored(stored) = &events[0] else {
            panic!()
        };
        assert_eq!(
            stored.extra_keys,
            Some(vec![Some(vec![ExtraKey::Text("t".into())]), None])
        );
        assert_ne!(
            stored.block_hashes[0].block_key(),
            digests[0].block_key(),
            "opaque hashes"
        );
    }
}
