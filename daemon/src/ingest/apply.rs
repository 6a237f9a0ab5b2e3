//! Applying one endpoint's decoded batches to the index, in its key space.
//!
//! An endpoint is *aligned* when the hashes it publishes are kvaffine's keys (vLLM runs
//! `sha256_cbor` with the same seed and block size): they are indexed as they come. It is
//! *re-keyed* when they are not (vLLM's default pickle `sha256`, another seed): kvaffine
//! recomputes each block's key from its tokens and parent chain, and keeps an engine-hash
//! to key map so `BlockRemoved` can be translated. The mode is detected, never configured.

use std::collections::HashMap;
use std::sync::Arc;

use foldhash::fast::RandomState;
use kvaffine_core::events::{BlockRemoved, BlockStored, EngineHash, EventBatch, ExtraKey, KvEvent};
use kvaffine_core::{CacheSalt, Digest, KeyConfig, KeyExtras, LoraAdapter, salt_tag};

use crate::hybrid::{Layout, group_of};
use crate::index::{PrefixIndex, Slot};

/// How an endpoint's published hashes relate to kvaffine's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// No block starting at token 0 has been checked yet.
    Unknown,
    /// Published hashes are kvaffine's keys.
    Aligned,
    /// Published hashes differ; keys are recomputed from tokens.
    Rekeyed,
}

impl Alignment {
    /// The name shown in `/v1/endpoints` and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Aligned => "aligned",
            Self::Rekeyed => "rekeyed",
        }
    }
}

/// What applying a batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// (block, slot) pairs indexed.
    pub stored: usize,
    /// Keys of every block stored, in kvaffine's key space (bookings confirm against them).
    pub stored_keys: Vec<u64>,
    /// The salt tags of the first blocks stored: a pick routed by its salt alone (no
    /// keys) is done, as far as events can say, once its salt's first block is stored.
    pub stored_salts: Vec<u64>,
    /// (block, slot) pairs forgotten.
    pub removed: usize,
    /// Pairs refused at the index's entry limit.
    pub dropped: usize,
    /// Blocks that could not be re-keyed (unknown parent or LoRA path, odd token count).
    pub orphans: usize,
    /// `AllBlocksCleared` was applied.
    pub cleared: bool,
    /// The endpoint just turned out not to be aligned: its entries were purged and it must
    /// be replayed from the start to rebuild them in kvaffine's key space.
    pub needs_resync: bool,
    /// A block size other than the daemon's, as the events report it.
    pub foreign_block_size: Option<u64>,
    /// A store named a KV-cache group not seen before, or changed one.
    pub layout_changed: bool,
}

/// Verify one in this many token-0 events once aligned, so a replica reconfigured under
/// the daemon is noticed without hashing every event twice.
const SPOT_CHECK_EVERY: u32 = 16;

/// Per-endpoint key-space state; owned by that endpoint's ingest thread.
pub struct Applier {
    slot: Slot,
    keys: KeyConfig,
    lora_paths: Arc<HashMap<String, String>>,
    alignment: Alignment,
    /// Engine hash -> kvaffine's digest, and how many stored copies (in any group) still
    /// name it: a block leaves the map when its last copy is removed, so a sliding-window
    /// eviction does not orphan the blocks after it.
    rekey: HashMap<u64, (Digest, u32), RandomState>,
    token0_events: u32,
    layout: Layout,
}

impl Applier {
    /// State for the endpoint in `slot`, keyed with `keys`; `lora_paths` maps adapter names
    /// to the paths replicas load them from (vLLM >= 0.31 hashes the path).
    pub fn new(slot: Slot, keys: KeyConfig, lora_paths: Arc<HashMap<String, String>>) -> Self {
        Self {
            slot,
            keys,
            lora_paths,
            alignment: Alignment::Unknown,
            rekey: HashMap::default(),
            token0_events: 0,
            layout: Layout::default(),
        }
    }

    /// The KV-cache groups the endpoint has published.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The endpoint's detected mode.
    pub fn alignment(&self) -> Alignment {
        self.alignment
    }

    /// Entries of the engine-hash map (re-keyed endpoints only).
    pub fn rekey_entries(&self) -> usize {
        self.rekey.len()
    }

    /// Forgets the endpoint's translation state and groups (its index entries are purged
    /// separately): a restarted replica may serve another model.
    pub fn reset(&mut self) {
        self.rekey.clear();
        self.layout = Layout::default();
    }

    /// Applies every event of `batch` in order.
    pub fn apply(&mut self, batch: &EventBatch, index: &mut PrefixIndex) -> ApplyReport {
        let mut report = ApplyReport::default();
        let ahead = self.translations_ahead(batch);
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => self.stored(stored, &ahead, index, &mut report),
                KvEvent::BlockRemoved(removed) => self.removed(removed, index, &mut report),
                KvEvent::AllBlocksCleared => {
                    report.removed += index.purge(self.slot);
                    self.rekey.clear();
                    report.cleared = true;
                }
            }
            if report.needs_resync {
                break;
            }
        }
        report
    }

    fn extras_of(&self, event: &BlockStored, block0: bool) -> Option<KeyExtras> {
        let items = event
            .extra_keys
            .as_ref()
            .and_then(|per_block| per_block.first())
            .and_then(Option::as_ref);
        let mut texts = items.into_iter().flatten().filter_map(|k| match k {
            ExtraKey::Text(t) => Some(t.as_str()),
            ExtraKey::Other(_) => None,
        });
        let lora = match &event.lora_name {
            Some(name) => {
                texts.next();
                Some(LoraAdapter {
                    name: name.clone(),
                    path: self.lora_paths.get(name)?.clone(),
                })
            }
            None => None,
        };
        let cache_salt = if block0 {
            texts.next().and_then(|s| CacheSalt::parse(s).ok())
        } else {
            None
        };
        Some(KeyExtras { lora, cache_salt })
    }

    /// Our digests of the event's blocks, when they can be computed.
    fn digests_of(&self, event: &BlockStored, ahead: &Ahead) -> Option<Vec<Digest>> {
        let block_size = self.keys.block_size();
        if event.block_size != block_size as u64
            || event.token_ids.len() != event.block_hashes.len() * block_size
        {
            return None;
        }
        let mut chain = match &event.parent_block_hash {
            None => self.keys.chain(&self.extras_of(event, true)?),
            Some(parent) => {
                let parent = self.translate(parent.block_key().0, ahead)?;
                self.keys
                    .chain_after(&self.extras_of(event, false)?, parent)
            }
        };
        chain.extend(&event.token_ids);
        Some(chain.into_digests())
    }

    /// kvaffine's digest of an engine hash: from the blocks the endpoint holds, or from a
    /// store later in the batch being applied.
    fn translate(&self, engine: u64, ahead: &Ahead) -> Option<Digest> {
        self.rekey
            .get(&engine)
            .map(|(digest, _)| *digest)
            .or_else(|| ahead.get(&engine).copied())
    }

    /// A sliding-window group's store lists only the blocks it keeps, so a re-keyed
    /// endpoint can translate its hashes only through the full-attention store of the same
    /// blocks, which vLLM may publish after it in the same batch (Gemma 3's window group
    /// is group 0). Such batches are translated ahead, without indexing anything.
    fn translations_ahead(&self, batch: &EventBatch) -> Ahead {
        let mut ahead = Ahead::default();
        let sparse =
            |s: &BlockStored| s.token_ids.len() != s.block_hashes.len() * self.keys.block_size();
        let needed = self.alignment == Alignment::Rekeyed
            && batch.events.iter().any(|e| match e {
                KvEvent::BlockStored(s) => sparse(s),
                _ => false,
            });
        if !needed {
            return ahead;
        }
        for event in &batch.events {
            if let KvEvent::BlockStored(s) = event {
                if sparse(s) {
                    continue;
                }
                if let Some(digests) = self.digests_of(s, &ahead) {
                    for (engine, digest) in s.block_hashes.iter().zip(digests) {
                        ahead.insert(engine.block_key().0, digest);
                    }
                }
            }
        }
        ahead
    }

    fn stored(
        &mut self,
        event: &BlockStored,
        ahead: &Ahead,
        index: &mut PrefixIndex,
        report: &mut ApplyReport,
    ) {
        if event.block_size != self.keys.block_size() as u64 {
            report.foreign_block_size = Some(event.block_size);
        }
        let Some(group) = group_of(event.group_idx) else {
            report.orphans += event.block_hashes.len();
            return;
        };
        let medium = event.medium.as_deref().unwrap_or(crate::index::GPU);
        report.layout_changed |= self.layout.learn_store(event);
        if event.parent_block_hash.is_none() && self.alignment != Alignment::Rekeyed {
            self.check_alignment(event, index, report);
            if report.needs_resync {
                return;
            }
        }
        let published: Vec<u64> = event.block_hashes.iter().map(|h| h.block_key().0).collect();
        if self.alignment != Alignment::Rekeyed {
            let outcome = index.store(self.slot, medium, group, &published);
            if let (None, Some(&root)) = (&event.parent_block_hash, published.first()) {
                self.note_root(event, root, index, report);
            }
            report.stored += outcome.added;
            report.dropped += outcome.dropped;
            report.stored_keys.extend_from_slice(&published);
            return;
        }
        let translated: Vec<(u64, Digest)> =
            if event.token_ids.len() == published.len() * self.keys.block_size() {
                let Some(digests) = self.digests_of(event, ahead) else {
                    report.orphans += event.block_hashes.len();
                    return;
                };
                published.iter().copied().zip(digests).collect()
            } else {
                // A window group's store: only the blocks it keeps, named by the hashes the
                // full-attention groups gave them; one that cannot be named is lost alone.
                let named: Vec<(u64, Digest)> = published
                    .iter()
                    .filter_map(|&engine| Some((engine, self.translate(engine, ahead)?)))
                    .collect();
                report.orphans += published.len() - named.len();
                named
            };
        let keys: Vec<u64> = translated.iter().map(|(_, d)| d.block_key().0).collect();
        for (engine, digest) in &translated {
            self.rekey.entry(*engine).or_insert((*digest, 0)).1 += 1;
        }
        let outcome = index.store(self.slot, medium, group, &keys);
        let root = translated
            .first()
            .filter(|(engine, _)| {
                event.parent_block_hash.is_none() && published.first() == Some(engine)
            })
            .map(|(_, digest)| digest.block_key().0);
        if let Some(root) = root {
            self.note_root(event, root, index, report);
        }
        report.stored += outcome.added;
        report.dropped += outcome.dropped;
        report.stored_keys.extend_from_slice(&keys);
    }

    /// Notes the salts of a stored first block, in the index and for the confirmations.
    fn note_root(
        &self,
        event: &BlockStored,
        root: u64,
        index: &mut PrefixIndex,
        report: &mut ApplyReport,
    ) {
        let tags = salt_tags(event);
        if let Some(tags) = &tags {
            report.stored_salts.extend_from_slice(tags);
        }
        index.salts.stored(self.slot, root, tags);
    }

    fn check_alignment(
        &mut self,
        event: &BlockStored,
        index: &mut PrefixIndex,
        report: &mut ApplyReport,
    ) {
        self.token0_events = self.token0_events.wrapping_add(1);
        if self.alignment == Alignment::Aligned && self.token0_events % SPOT_CHECK_EVERY != 0 {
            return;
        }
        let Some(digests) = self.digests_of(event, &Ahead::default()) else {
            return;
        };
        let matches = digests
            .iter()
            .zip(&event.block_hashes)
            .all(|(ours, theirs)| match theirs {
                EngineHash::Int(v) => ours.block_key().0 == *v,
                EngineHash::Digest(d) => ours == d,
            });
        if matches {
            self.alignment = Alignment::Aligned;
            return;
        }
        let was = self.alignment;
        self.alignment = Alignment::Rekeyed;
        report.removed += index.purge(self.slot);
        self.rekey.clear();
        if was == Alignment::Unknown || was == Alignment::Aligned {
            report.needs_resync = true;
        }
    }

    fn removed(&mut self, event: &BlockRemoved, index: &mut PrefixIndex, report: &mut ApplyReport) {
        let medium = event.medium.as_deref().unwrap_or(crate::index::GPU);
        let Some(group) = group_of(event.group_idx) else {
            return;
        };
        let keys: Vec<u64> = match self.alignment {
            Alignment::Rekeyed => event
                .block_hashes
                .iter()
                .filter_map(|h| self.release(h.block_key().0))
                .collect(),
            Alignment::Unknown | Alignment::Aligned => {
                event.block_hashes.iter().map(|h| h.block_key().0).collect()
            }
        };
        report.removed += index.remove(self.slot, medium, group, &keys);
    }

    /// One stored copy of `engine` is gone: its key, forgotten with its last copy.
    fn release(&mut self, engine: u64) -> Option<u64> {
        let std::collections::hash_map::Entry::Occupied(mut entry) = self.rekey.entry(engine)
        else {
            return None;
        };
        let (digest, copies) = entry.get_mut();
        let key = digest.block_key().0;
        *copies -= 1;
        if *copies == 0 {
            entry.remove();
        }
        Some(key)
    }
}

/// The salt tags of a first block's extra keys: every string but the LoRA name (vLLM
/// publishes the salt bare, after the LoRA name; multimodal keys are pairs), or None when
/// the event carries no extra keys at all (vLLM before 0.17), so its salts are unknowable.
fn salt_tags(event: &BlockStored) -> Option<Vec<u64>> {
    let first = event.extra_keys.as_ref()?.first().and_then(Option::as_ref);
    let mut texts = first.into_iter().flatten().filter_map(|k| match k {
        ExtraKey::Text(t) => Some(t.as_str()),
        ExtraKey::Other(_) => None,
    });
    if event.lora_name.is_some() {
        texts.next();
    }
    Some(texts.map(salt_tag).collect())
}

/// Translations of engine hashes computed ahead for one batch.
type Ahead = HashMap<u64, Digest, RandomState>;
