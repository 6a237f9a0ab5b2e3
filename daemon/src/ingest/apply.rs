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
use kvaffine_core::{CacheSalt, Digest, KeyConfig, KeyExtras, LoraAdapter};

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
    rekey: HashMap<u64, Digest, RandomState>,
    token0_events: u32,
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
        }
    }

    /// The endpoint's detected mode.
    pub fn alignment(&self) -> Alignment {
        self.alignment
    }

    /// Entries of the engine-hash map (re-keyed endpoints only).
    pub fn rekey_entries(&self) -> usize {
        self.rekey.len()
    }

    /// Forgets the endpoint's translation state (its index entries are purged separately).
    pub fn reset(&mut self) {
        self.rekey.clear();
    }

    /// Applies every event of `batch` in order.
    pub fn apply(&mut self, batch: &EventBatch, index: &mut PrefixIndex) -> ApplyReport {
        let mut report = ApplyReport::default();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => self.stored(stored, index, &mut report),
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
    fn digests_of(&self, event: &BlockStored) -> Option<Vec<Digest>> {
        let block_size = self.keys.block_size();
        if event.block_size != block_size as u64
            || event.token_ids.len() != event.block_hashes.len() * block_size
        {
            return None;
        }
        let mut chain = match &event.parent_block_hash {
            None => self.keys.chain(&self.extras_of(event, true)?),
            Some(parent) => {
                let parent = self.rekey.get(&parent.block_key().0)?;
                self.keys
                    .chain_after(&self.extras_of(event, false)?, *parent)
            }
        };
        chain.extend(&event.token_ids);
        Some(chain.into_digests())
    }

    fn stored(&mut self, event: &BlockStored, index: &mut PrefixIndex, report: &mut ApplyReport) {
        if event.block_size != self.keys.block_size() as u64 {
            report.foreign_block_size = Some(event.block_size);
        }
        let medium = event.medium.as_deref().unwrap_or(crate::index::GPU);
        if event.parent_block_hash.is_none() && self.alignment != Alignment::Rekeyed {
            self.check_alignment(event, index, report);
            if report.needs_resync {
                return;
            }
        }
        let published: Vec<u64> = event.block_hashes.iter().map(|h| h.block_key().0).collect();
        if self.alignment != Alignment::Rekeyed {
            let outcome = index.store(self.slot, medium, &published);
            report.stored += outcome.added;
            report.dropped += outcome.dropped;
            report.stored_keys.extend_from_slice(&published);
            return;
        }
        let Some(digests) = self.digests_of(event) else {
            report.orphans += event.block_hashes.len();
            return;
        };
        let keys: Vec<u64> = digests.iter().map(|d| d.block_key().0).collect();
        for (engine, digest) in published.iter().zip(&digests) {
            self.rekey.insert(*engine, *digest);
        }
        let outcome = index.store(self.slot, medium, &keys);
        report.stored += outcome.added;
        report.dropped += outcome.dropped;
        report.stored_keys.extend_from_slice(&keys);
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
        let Some(digests) = self.digests_of(event) else {
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
        let keys: Vec<u64> = match self.alignment {
            Alignment::Rekeyed => event
                .block_hashes
                .iter()
                .filter_map(|h| self.rekey.remove(&h.block_key().0))
                .map(|d| d.block_key().0)
                .collect(),
            Alignment::Unknown | Alignment::Aligned => {
                event.block_hashes.iter().map(|h| h.block_key().0).collect()
            }
        };
        report.removed += index.remove(self.slot, medium, &keys);
    }
}
