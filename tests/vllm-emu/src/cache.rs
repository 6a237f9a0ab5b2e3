//! The prefix cache of one replica, as vLLM's block pool behaves where a router can see it:
//! full blocks are cached under their keys, requests reference them, unreferenced cached
//! blocks are evicted least recently used first (a request's tail before its head), and
//! every change becomes a KV event.
//!
//! A hybrid-attention model (`--sliding-window`, shaped as vLLM 0.32 serves a Gemma 3: a
//! sliding-window group 0 and a full-attention group 1) adds the window group: it caches
//! only the window before a prompt's servable end and, after a hybrid miss, the window
//! before the point where the full-attention hit ended; a hit needs the window before it;
//! the full-attention group stores a recomputed prefix again as another copy; window
//! blocks are freed before the full-attention ones, so they are evicted first.

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

/// One physical block.
#[derive(Clone, Copy, Debug)]
struct Copy {
    id: u64,
    refs: u32,
    /// Position in the eviction order while unreferenced.
    free_tick: Option<u64>,
}

/// A cached block's content, held in one or more physical copies: vLLM recomputes a
/// prefix it holds after a hybrid miss, storing another copy; each is referenced, freed,
/// evicted and reported on its own, and a hit takes the oldest.
#[derive(Default)]
struct Group {
    blocks: HashMap<Digest, Vec<Copy>>,
    /// Physical copies, all blocks together.
    copies: usize,
}

impl Group {
    fn holds(&self, digest: &Digest) -> bool {
        self.blocks.contains_key(digest)
    }

    fn clear(&mut self) {
        self.blocks.clear();
        self.copies = 0;
    }
}

/// The sliding-window group of a hybrid model.
struct WindowGroup {
    /// Its window, in tokens.
    window: u64,
    /// Blocks before a hit point it must hold: `ceil((window - 1) / block_size)`.
    needed: usize,
    group: Group,
}

/// Which group a physical block is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Full,
    Window,
}

/// Blocks held for one running request.
#[derive(Debug, Default)]
pub struct Holding {
    /// Digests of its cached blocks, in order.
    pub blocks: Vec<Digest>,
    /// The copy of each of them it holds.
    copies: Vec<u64>,
    /// Whether it also holds one partial (uncached) block.
    pub partial: bool,
    /// Blocks allocated for its prefill and not yet cached.
    pub reserved: usize,
    /// Window-group blocks its prefill holds until it is done (hybrid models).
    transient: usize,
    /// Window-group blocks it holds (hybrid models), and their copies.
    windows: Vec<(Digest, u64)>,
    /// Leading blocks the full-attention group held when it was admitted.
    full_hit: usize,
}

/// Not enough unreferenced blocks to admit a request now.
#[derive(Debug, PartialEq, Eq)]
pub struct NoCapacity;

/// One replica's KV-cache blocks.
pub struct PrefixCache {
    capacity: usize,
    block_size: usize,
    mode: EngineHashMode,
    full: Group,
    /// The window group, on a hybrid model.
    window: Option<WindowGroup>,
    /// Unreferenced physical blocks by the tick they were freed: evicted lowest first.
    free: BTreeMap<u64, (Kind, Digest, u64)>,
    tick: u64,
    next_copy: u64,
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
            full: Group::default(),
            window: None,
            free: BTreeMap::new(),
            tick: 0,
            next_copy: 0,
            partials: 0,
            reserved: 0,
            events: Vec::new(),
        }
    }

    /// The same cache for a hybrid model whose window group keeps `window` tokens.
    pub fn with_window(mut self, window: u64) -> Self {
        let needed = window
            .saturating_sub(1)
            .div_ceil(self.block_size.max(1) as u64);
        self.window = Some(WindowGroup {
            window,
            needed: usize::try_from(needed).unwrap_or(usize::MAX),
            group: Group::default(),
        });
        self
    }

    /// Blocks a prompt of `blocks` full blocks needs to be admitted into an empty cache:
    /// its blocks and a partial one, and on a hybrid model a window block per block while
    /// it is prefilled, and the window it keeps.
    pub fn admission_need(&self, blocks: usize) -> usize {
        match &self.window {
            None => blocks + 1,
            Some(window) => 2 * blocks + 1 + window.needed,
        }
    }

    /// The full-attention group's number in events: 1 beside a window group 0.
    fn full_group(&self) -> i64 {
        i64::from(self.window.is_some())
    }

    fn group_mut(&mut self, kind: Kind) -> Option<&mut Group> {
        match kind {
            Kind::Full => Some(&mut self.full),
            Kind::Window => self.window.as_mut().map(|w| &mut w.group),
        }
    }

    /// Leading blocks of `digests`, at most `cap`, that a request is served from cache:
    /// the full-attention prefix, cut on a hybrid model to the last point whose window
    /// blocks before it are cached (or to a shorter run of them from block 0).
    pub fn hit(&self, digests: &[Digest], cap: usize) -> usize {
        let full = self.cached_prefix(digests).min(cap);
        let Some(window) = &self.window else {
            return full;
        };
        (1..=full)
            .rev()
            .find(|&end| {
                digests
                    .get(end.saturating_sub(window.needed)..end)
                    .is_some_and(|before| before.iter().all(|d| window.group.holds(d)))
            })
            .unwrap_or(0)
    }

    /// Fraction of blocks in use or cached (`vllm:kv_cache_usage_perc` counts blocks held by
    /// requests; cached free blocks are reusable, so they do not count).
    pub fn usage(&self) -> f64 {
        let held = self.in_use().saturating_sub(self.free.len());
        held as f64 / self.capacity.max(1) as f64
    }

    /// Events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Leading blocks of `digests` that are cached.
    pub fn cached_prefix(&self, digests: &[Digest]) -> usize {
        digests.iter().take_while(|d| self.full.holds(d)).count()
    }

    fn in_use(&self) -> usize {
        let windows = self.window.as_ref().map_or(0, |w| w.group.copies);
        self.full.copies + windows + self.partials + self.reserved
    }

    fn evict_one(&mut self, keep: &[Digest]) -> bool {
        let victim = self
            .free
            .iter()
            .find(|(_, (_, d, _))| !keep.contains(d))
            .map(|(t, entry)| (*t, *entry));
        let Some((tick, (kind, digest, id))) = victim else {
            return false;
        };
        self.free.remove(&tick);
        if let Some(group) = self.group_mut(kind) {
            if let Some(copies) = group.blocks.get_mut(&digest) {
                copies.retain(|c| c.id != id);
                group.copies -= 1;
                if copies.is_empty() {
                    group.blocks.remove(&digest);
                }
            }
        }
        let group = match kind {
            Kind::Full => self.full_group(),
            Kind::Window => 0,
        };
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash::Int(self.mode.hash(&digest))],
            medium: Some("GPU".into()),
            group_idx: Some(group),
            ..BlockRemoved::default()
        }));
        true
    }

    /// A request takes `digest`'s oldest copy in `kind`'s group; returns the copy.
    fn reference(&mut self, kind: Kind, digest: &Digest) -> Option<u64> {
        let copy = self.group_mut(kind)?.blocks.get_mut(digest)?.first_mut()?;
        copy.refs += 1;
        let (id, tick) = (copy.id, copy.free_tick.take());
        if let Some(tick) = tick {
            self.free.remove(&tick);
        }
        Some(id)
    }

    /// A new physical copy of `digest` in `kind`'s group, held by one request.
    fn new_copy(&mut self, kind: Kind, digest: &Digest) -> Option<u64> {
        let id = self.next_copy;
        let group = self.group_mut(kind)?;
        group.blocks.entry(*digest).or_default().push(Copy {
            id,
            refs: 1,
            free_tick: None,
        });
        group.copies += 1;
        self.next_copy += 1;
        Some(id)
    }

    /// A request lets go of a copy; unreferenced, it joins the eviction order.
    fn unreference(&mut self, kind: Kind, digest: &Digest, id: u64) {
        let tick = self.tick + 1;
        let Some(copy) = self
            .group_mut(kind)
            .and_then(|g| g.blocks.get_mut(digest))
            .and_then(|copies| copies.iter_mut().find(|c| c.id == id))
        else {
            return;
        };
        copy.refs = copy.refs.saturating_sub(1);
        if copy.refs == 0 && copy.free_tick.is_none() {
            copy.free_tick = Some(tick);
            self.tick = tick;
            self.free.insert(tick, (kind, *digest, id));
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
        let hits = self.hit(digests, hit_cap);
        let new_blocks = digests.len() - hits;
        let windows = self.window.as_ref().map_or(0, |w| w.needed);
        // A prefill computes every new token's sliding-window KV in one step: the window
        // group holds a block per new block until the step is done, then keeps only its
        // window (vLLM frees the rest after the step).
        let transient = if self.window.is_some() { new_blocks } else { 0 };
        let need = new_blocks + transient + 1 + windows;
        let keep = digests.get(..hits).unwrap_or(&[]);
        while self.capacity.saturating_sub(self.in_use()) < need {
            if !self.evict_one(keep) {
                return Err(NoCapacity);
            }
        }
        holding.full_hit = self.cached_prefix(digests).min(hit_cap);
        self.take_prefix(digests, holding.blocks.len(), hits, holding);
        holding.reserved = new_blocks;
        holding.transient = transient;
        self.reserved += new_blocks + transient;
        self.partials += 1;
        holding.partial = true;
        Ok(hits)
    }

    /// References `digests[from..hit]` as cached blocks of `holding`, and on a hybrid
    /// model the window blocks before `hit`.
    fn take_prefix(&mut self, digests: &[Digest], from: usize, hit: usize, holding: &mut Holding) {
        for digest in digests.get(from..hit).unwrap_or(&[]) {
            if let Some(id) = self.reference(Kind::Full, digest) {
                holding.blocks.push(*digest);
                holding.copies.push(id);
            }
        }
        let needed = self.window.as_ref().map_or(0, |w| w.needed);
        for digest in digests.get(hit.saturating_sub(needed)..hit).unwrap_or(&[]) {
            if self.window.is_some() && holding.windows.iter().all(|(d, _)| d != digest) {
                if let Some(id) = self.reference(Kind::Window, digest) {
                    holding.windows.push((*digest, id));
                }
            }
        }
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
        let hit = self.hit(digests, hit_cap);
        let adopted = hit.saturating_sub(from).min(holding.reserved);
        if adopted == 0 || (self.window.is_some() && from + adopted != hit) {
            return 0;
        }
        self.take_prefix(digests, from, from + adopted, holding);
        holding.full_hit = holding.full_hit.max(from + adopted);
        holding.reserved -= adopted;
        self.reserved -= adopted;
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
        self.reserved -= holding.reserved + holding.transient;
        (holding.reserved, holding.transient) = (0, 0);
        let from = holding.blocks.len();
        self.store_windows(tokens, digests, from, extras, holding);
        self.store(tokens, digests, from, extras, holding);
    }

    /// The window blocks a prefill leaves cached on a hybrid model (vLLM 0.32's default
    /// retention): the window before the prompt's servable end, and after a hybrid miss
    /// the window before where the full-attention hit ended; only blocks this prefill
    /// computed. Published before the full-attention store, as vLLM's group 0.
    fn store_windows(
        &mut self,
        tokens: &[u32],
        digests: &[Digest],
        from: usize,
        extras: &KeyExtras,
        holding: &mut Holding,
    ) {
        let Some((needed, window)) = self.window.as_ref().map(|w| (w.needed, w.window)) else {
            return;
        };
        let servable = tokens.len().saturating_sub(1) / self.block_size.max(1);
        let mut kept: Vec<usize> = (servable.saturating_sub(needed).max(from)..servable).collect();
        if holding.full_hit > from {
            kept.extend(holding.full_hit.saturating_sub(needed).max(from)..holding.full_hit);
        }
        kept.sort_unstable();
        kept.dedup();
        let mut hashes = Vec::new();
        for digest in kept.iter().filter_map(|&b| digests.get(b)) {
            if self.capacity.saturating_sub(self.in_use()) == 0 && !self.evict_one(digests) {
                break;
            }
            if let Some(id) = self.new_copy(Kind::Window, digest) {
                holding.windows.push((*digest, id));
                hashes.push(EngineHash::Int(self.mode.hash(digest)));
            }
        }
        let event = BlockStored {
            block_hashes: hashes,
            group_idx: Some(0),
            kv_cache_spec_kind: Some("sliding_window".into()),
            kv_cache_spec_sliding_window: i64::try_from(window).ok(),
            ..self.stored_range(tokens, digests, from..digests.len(), extras)
        };
        self.events.push(KvEvent::BlockStored(event));
    }

    /// A `BlockStored` for blocks `range` of `tokens` as vLLM fills one in: their tokens,
    /// the parent before them, the LoRA and per-block extra keys; its hashes name every
    /// block of the range (a window store keeps fewer).
    fn stored_range(
        &self,
        tokens: &[u32],
        digests: &[Digest],
        range: std::ops::Range<usize>,
        extras: &KeyExtras,
    ) -> BlockStored {
        let hash = |d: &Digest| EngineHash::Int(self.mode.hash(d));
        let block_size = self.block_size;
        BlockStored {
            block_hashes: digests
                .get(range.clone())
                .unwrap_or(&[])
                .iter()
                .map(hash)
                .collect(),
            parent_block_hash: range
                .start
                .checked_sub(1)
                .and_then(|p| digests.get(p))
                .map(hash),
            token_ids: tokens
                .get(range.start * block_size..range.end * block_size)
                .unwrap_or(&[])
                .to_vec(),
            block_size: block_size as u64,
            lora_id: extras.lora.as_ref().map(|_| 1),
            medium: Some("GPU".into()),
            lora_name: extras.lora.as_ref().map(|l| l.name.clone()),
            extra_keys: Some(range.map(|b| Self::event_extras(extras, b)).collect()),
            ..BlockStored::default()
        }
    }

    /// A block's `extra_keys` entry as vLLM publishes it: the LoRA name, and the bare salt
    /// on block 0.
    fn event_extras(extras: &KeyExtras, block: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(lora) = &extras.lora {
            keys.push(ExtraKey::Text(lora.name.clone()));
        }
        if let (0, Some(salt)) = (block, &extras.cache_salt) {
            keys.push(ExtraKey::Text(salt.as_str().to_owned()));
        }
        (!keys.is_empty()).then_some(keys)
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
        let hybrid = self.window.is_some();
        for (i, digest) in digests.iter().enumerate().skip(from) {
            // A hybrid model recomputes what a hybrid miss could not use: another copy.
            let id = match self.full.holds(digest) && !hybrid {
                true => self.reference(Kind::Full, digest),
                false => {
                    stored.push(i);
                    self.new_copy(Kind::Full, digest)
                }
            };
            if let Some(id) = id {
                holding.blocks.push(*digest);
                holding.copies.push(id);
            }
        }
        let (Some(&first), Some(&last)) = (stored.first(), stored.last()) else {
            return;
        };
        // One event per contiguous run, as vLLM reports each cache_full_blocks call.
        let group = self.full_group();
        let mut run_start = first;
        for (n, &i) in stored.iter().enumerate() {
            let run_ends = stored.get(n + 1).is_none_or(|&next| next != i + 1);
            if !run_ends {
                continue;
            }
            let event = BlockStored {
                group_idx: Some(group),
                kv_cache_spec_kind: Some("full_attention".into()),
                ..self.stored_range(tokens, digests, run_start..i + 1, extras)
            };
            self.events.push(KvEvent::BlockStored(event));
            if let Some(&next) = stored.get(n + 1) {
                run_start = next;
            }
        }
        debug_assert!(last >= first);
    }

    /// Generation filled more blocks: cache `digests[held..]` (the request's whole token
    /// list is `tokens`), in the full-attention group only. Blocks that cannot be
    /// allocated are simply not cached.
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

    /// The request finished: its blocks become evictable, window blocks first, then the
    /// full-attention ones tail first.
    pub fn release(&mut self, holding: Holding) {
        self.reserved -= holding.reserved + holding.transient;
        if holding.partial {
            self.partials = self.partials.saturating_sub(1);
        }
        for (digest, id) in &holding.windows {
            self.unreference(Kind::Window, digest, *id);
        }
        for (digest, id) in holding.blocks.iter().zip(&holding.copies).rev() {
            self.unreference(Kind::Full, digest, *id);
        }
    }

    /// Drops every cached block (`POST /reset_prefix_cache`); refused while requests run,
    /// as vLLM refuses.
    pub fn reset(&mut self) -> bool {
        let windows = self.window.as_ref().map_or(0, |w| w.group.copies);
        if self.full.copies + windows != self.free.len() || self.partials != 0 || self.reserved != 0
        {
            return false;
        }
        self.full.clear();
        if let Some(window) = &mut self.window {
            window.group.clear();
        }
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

    /// One request through admission, prefill and release; returns the blocks it hit.
    fn serve(cache: &mut PrefixCache, keys: &KeyConfig, tokens: &[u32]) -> usize {
        let extras = KeyExtras::default();
        let digests = keys.digests(&extras, tokens);
        let mut h = Holding::default();
        let cap = tokens.len().saturating_sub(1) / 4;
        let hits = cache.admit(&digests, cap, &mut h).unwrap();
        cache.commit_prefill(tokens, &digests, &extras, &mut h);
        cache.release(h);
        hits
    }

    #[test]
    fn a_hybrid_hit_needs_the_window_before_it_and_a_miss_keeps_its_junction() {
        let keys = config();
        // Blocks of 4 tokens, a window of 8: a hit needs the 2 blocks before it.
        let mut cache = PrefixCache::new(1000, 4, EngineHashMode::Keys).with_window(8);
        let shared: Vec<u32> = (0..40).collect();
        let branch = |seed: u32| -> Vec<u32> {
            let mut t = shared.clone();
            t.extend((0..22).map(|i| 1000 * seed + i));
            t
        };
        assert_eq!(serve(&mut cache, &keys, &branch(1)), 0);
        let events = cache.take_events();
        let KvEvent::BlockStored(window) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(
            (
                window.group_idx,
                window.block_hashes.len(),
                window.token_ids.len()
            ),
            (Some(0), 2, 60),
            "the window group keeps the 2 blocks before the servable end (block 15)"
        );
        // A sibling branching at block 10: full attention holds 10 blocks, no window ends
        // there: a miss, which stores the shared blocks again and keeps the junction.
        assert_eq!(serve(&mut cache, &keys, &branch(2)), 0);
        let events = cache.take_events();
        let hashes = |e: &KvEvent| match e {
            KvEvent::BlockStored(s) => (s.group_idx, s.block_hashes.len()),
            _ => (None, 0),
        };
        assert_eq!(hashes(&events[0]), (Some(0), 4), "junction and end windows");
        assert_eq!(hashes(&events[1]), (Some(1), 15), "the whole prompt again");
        assert_eq!(serve(&mut cache, &keys, &branch(3)), 10);
        assert_eq!(serve(&mut cache, &keys, &branch(1)), 15);
    }

    #[test]
    fn hybrid_window_blocks_are_evicted_first() {
        let keys = config();
        let mut cache = PrefixCache::new(11, 4, EngineHashMode::Keys).with_window(8);
        let a: Vec<u32> = (0..17).collect();
        serve(&mut cache, &keys, &a);
        cache.take_events();
        // 4 full blocks and 2 window blocks cached; a new prompt of 4 blocks needs 4 + 1 + 2.
        let b: Vec<u32> = (100..117).collect();
        serve(&mut cache, &keys, &b);
        let removed: Vec<Option<i64>> = cache
            .take_events()
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved(r) => Some(r.group_idx),
                _ => None,
            })
            .collect();
        assert_eq!(removed.first(), Some(&Some(0)), "{removed:?}");
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
