//! The prefix index: which endpoint slots hold which block keys, per storage tier and
//! KV-cache group.
//!
//! One hash map per (tier, group) from block key to its holders, packed in 64 bits
//! ([`Holders`]: a bitmask in a small fleet, a bitmap aside for a block many of a large
//! fleet hold). Block keys are truncated SHA-256 or XXH3 digests, so they spread evenly
//! under a cheap hasher. Memory per key is one 16-byte entry plus hashbrown's control byte
//! and load-factor slack, shared by every endpoint holding the block (figures in
//! `docs/benchmarks/daemon.md` and `docs/benchmarks/scale.md`).
//! A hybrid-attention model (sliding-window and full-attention layers) publishes each
//! group's blocks apart, so each group has its own table; which group means what is the
//! endpoint's [layout](crate::hybrid::Layout), read where the tables are asked.

use std::collections::{BTreeMap, HashMap};

use hashbrown::hash_map::Entry;

use crate::huge::HugeMap;
use crate::salts::SaltIndex;
pub use crate::slots::{Depths, MAX_SLOTS, Slot, longest_prefixes_by};
use crate::slots::{HolderView, Holders, NO_SPILL, Spill};

/// The tier vLLM's own GPU block pool reports, and the one lookups rank on.
pub const GPU: &str = "GPU";

/// A KV-cache group's number, as vLLM's events give it (`group_idx`; 0 for a model with
/// one group, and for versions that do not say).
pub type Group = u32;

/// One (tier, group)'s blocks.
#[derive(Debug, Default)]
struct Table {
    holders: HugeMap<u64, Holders>,
    /// The holder sets too large to pack in the table.
    spill: Spill,
    /// Copies of a (block, slot) beyond the first. vLLM can hold the same content in
    /// several physical blocks (a hybrid miss recomputes a prefix it already holds; two
    /// requests can compute one block at once), each stored and evicted with its own event:
    /// the slot holds the block until the last copy goes.
    extra_copies: HugeMap<(u64, Slot), u32>,
}

/// What a store did: entries are (block, slot) pairs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Pairs newly indexed.
    pub added: usize,
    /// Pairs refused because the index is at its entry limit.
    pub dropped: usize,
}

/// Block keys by tier, with a bound on (block, slot) entries and a fair share of it per
/// slot, so that one endpoint publishing without end cannot fill the index and leave no
/// room for the others' new blocks.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Tier -> group -> table.
    tiers: HashMap<String, BTreeMap<Group, Table>>,
    entries: usize,
    max_entries: usize,
    /// Entries held per slot.
    by_slot: Vec<usize>,
    /// The most one slot may hold: `max_entries` over the slots in use.
    share: usize,
    /// The salts of the first blocks held, kept with the blocks: removals and purges
    /// update both.
    pub salts: SaltIndex,
}

impl PrefixIndex {
    /// An empty index that holds at most `max_entries` (block, slot) pairs.
    pub fn new(max_entries: usize) -> Self {
        Self {
            tiers: HashMap::new(),
            entries: 0,
            max_entries,
            by_slot: vec![0; MAX_SLOTS],
            share: max_entries,
            salts: SaltIndex::default(),
        }
    }

    /// `slots` endpoints share the index from now on: each may hold at most its part of
    /// the bound. A slot already over its new share keeps what it holds and adds nothing
    /// until it is under it again.
    pub fn share_among(&mut self, slots: usize) {
        self.share = self.max_entries / slots.max(1);
    }

    /// Records that `slot` holds one more copy of each of `keys` in `medium`'s `group`.
    pub fn store(&mut self, slot: Slot, medium: &str, group: Group, keys: &[u64]) -> StoreOutcome {
        let groups = match self.tiers.get_mut(medium) {
            Some(g) => g,
            None => self.tiers.entry(medium.to_owned()).or_default(),
        };
        let table = groups.entry(group).or_default();
        let mut outcome = StoreOutcome::default();
        let Some(held) = self.by_slot.get_mut(slot.index()) else {
            return outcome;
        };
        let (holders, spill) = (&mut table.holders, &mut table.spill);
        for &key in keys {
            let full = self.entries >= self.max_entries || *held >= self.share;
            match holders.entry(key) {
                Entry::Occupied(set) if spill.contains(*set.get(), slot) => {
                    *table.extra_copies.entry((key, slot)).or_default() += 1;
                    continue;
                }
                _ if full => {
                    outcome.dropped += 1;
                    continue;
                }
                Entry::Occupied(mut set) => {
                    spill.insert(set.get_mut(), slot);
                }
                Entry::Vacant(set) => {
                    spill.insert(set.insert(Holders::default()), slot);
                }
            }
            self.entries += 1;
            *held += 1;
            outcome.added += 1;
        }
        outcome
    }

    /// Entries `slot` holds.
    pub fn slot_entries(&self, slot: Slot) -> usize {
        self.by_slot.get(slot.index()).copied().unwrap_or(0)
    }

    /// Records that `slot` holds one copy fewer of each of `keys` in `medium`'s `group`;
    /// returns the pairs of which it held the last copy.
    pub fn remove(&mut self, slot: Slot, medium: &str, group: Group, keys: &[u64]) -> usize {
        for &key in keys {
            self.salts.removed(slot, key);
        }
        let Some(table) = self.tiers.get_mut(medium).and_then(|g| g.get_mut(&group)) else {
            return 0;
        };
        let (holders, copies, spill) = (
            &mut table.holders,
            &mut table.extra_copies,
            &mut table.spill,
        );
        let mut removed = 0;
        for key in keys {
            if !copies.is_empty() {
                if let Entry::Occupied(mut extra) = copies.entry((*key, slot)) {
                    *extra.get_mut() -= 1;
                    if *extra.get() == 0 {
                        extra.remove();
                    }
                    continue;
                }
            }
            if let Entry::Occupied(mut set) = holders.entry(*key) {
                if spill.remove(set.get_mut(), slot) {
                    removed += 1;
                    if set.get().is_empty() {
                        set.remove();
                    }
                }
            }
        }
        self.entries -= removed;
        if let Some(held) = self.by_slot.get_mut(slot.index()) {
            *held -= removed;
        }
        removed
    }

    /// Forgets everything `slot` holds, in every tier (a restart, a cache reset, a removed
    /// endpoint); returns pairs removed.
    pub fn purge(&mut self, slot: Slot) -> usize {
        self.salts.purge(slot);
        let mut removed = 0;
        for table in self.tiers.values_mut().flat_map(BTreeMap::values_mut) {
            table.extra_copies.retain(|(_, s), _| *s != slot);
            let spill = &mut table.spill;
            table.holders.retain(|_, set| {
                if spill.remove(set, slot) {
                    removed += 1;
                }
                !set.is_empty()
            });
        }
        self.entries -= removed;
        if let Some(held) = self.by_slot.get_mut(slot.index()) {
            *held -= removed;
        }
        removed
    }

    /// For every slot, how many of `keys` it holds contiguously from `keys[0]` in
    /// `medium`'s `group`.
    pub fn longest_prefixes(&self, medium: &str, group: Group, keys: &[u64]) -> Depths {
        longest_prefixes_by(keys.iter().copied(), self.tier(medium, group))
    }

    /// The holders of `medium`'s `group`, for walks that add holders of their own.
    pub fn tier<'a>(&'a self, medium: &str, group: Group) -> impl Fn(u64) -> HolderView<'a> + 'a {
        let table = self.tiers.get(medium).and_then(|g| g.get(&group));
        move |key| match table {
            Some(t) => HolderView {
                holders: t.holders.get(&key).copied().unwrap_or_default(),
                spill: &t.spill,
            },
            None => HolderView {
                holders: Holders::default(),
                spill: &NO_SPILL,
            },
        }
    }

    /// Whether `slot` holds `key` in any of `medium`'s groups.
    pub fn holds_in_any_group(&self, medium: &str, key: u64, slot: Slot) -> bool {
        self.tiers.get(medium).is_some_and(|groups| {
            groups.values().any(|t| {
                t.holders
                    .get(&key)
                    .is_some_and(|h| t.spill.contains(*h, slot))
            })
        })
    }

    /// Whether `slot` holds `key` in `medium`'s `group`.
    pub fn holds(&self, medium: &str, group: Group, key: u64, slot: Slot) -> bool {
        self.tiers
            .get(medium)
            .and_then(|g| g.get(&group))
            .and_then(|t| Some(t.spill.contains(*t.holders.get(&key)?, slot)))
            .unwrap_or(false)
    }

    /// The tiers that have held blocks.
    pub fn media(&self) -> impl Iterator<Item = &str> {
        self.tiers.keys().map(String::as_str)
    }

    /// (block, slot) pairs held.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Bytes the tables hold, the copies side maps and spilled holders included.
    pub fn table_bytes(&self) -> usize {
        self.tiers
            .values()
            .flat_map(BTreeMap::values)
            .map(|t| {
                t.holders.allocation_size() + t.extra_copies.allocation_size() + t.spill.bytes()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: usize) -> Slot {
        Slot::new(n).unwrap()
    }

    #[test]
    fn matches_count_only_the_contiguous_run_from_the_first_key() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), GPU, 0, &[1, 2, 3]);
        index.store(slot(1), GPU, 0, &[1, 2, 4]);
        index.store(slot(2), GPU, 0, &[2, 3]);
        let m = index.longest_prefixes(GPU, 0, &[1, 2, 3, 9]);
        assert_eq!([0, 1, 2, 3].map(|n| m.get(n)), [3, 2, 0, 0]);
        assert_eq!(index.longest_prefixes("CPU", 0, &[1]).get(0), 0);
        assert_eq!(index.longest_prefixes(GPU, 0, &[]).get(0), 0);
    }

    #[test]
    fn tiers_are_kept_apart() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), "CPU", 0, &[1, 2]);
        assert_eq!(index.longest_prefixes(GPU, 0, &[1, 2]).get(0), 0);
        assert_eq!(index.longest_prefixes("CPU", 0, &[1, 2]).get(0), 2);
    }

    #[test]
    fn removal_and_purge_forget_only_that_slot() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), GPU, 0, &[1, 2, 3]);
        index.store(slot(5), GPU, 0, &[1, 2, 3]);
        assert_eq!(index.entries(), 6);
        assert_eq!(index.remove(slot(0), GPU, 0, &[2, 7]), 1);
        let m = index.longest_prefixes(GPU, 0, &[1, 2, 3]);
        assert_eq!([0, 1, 5].map(|n| m.get(n)), [1, 0, 3]);
        assert_eq!(index.purge(slot(5)), 3);
        assert_eq!(index.entries(), 2);
        assert_eq!(index.longest_prefixes(GPU, 0, &[1]).get(5), 0);
    }

    #[test]
    fn the_entry_limit_drops_new_pairs_and_counts_them() {
        let mut index = PrefixIndex::new(3);
        let outcome = index.store(slot(0), GPU, 0, &[1, 2, 3, 4]);
        assert_eq!(
            outcome,
            StoreOutcome {
                added: 3,
                dropped: 1
            }
        );
        assert_eq!(index.store(slot(1), GPU, 0, &[1]).dropped, 1);
        index.remove(slot(0), GPU, 0, &[3]);
        assert_eq!(index.store(slot(1), GPU, 0, &[1]).added, 1);
    }

    #[test]
    fn a_slot_holds_at_most_its_share_and_the_others_keep_room() {
        let mut index = PrefixIndex::new(10);
        index.share_among(2);
        let flood: Vec<u64> = (100..200).collect();
        let outcome = index.store(slot(0), GPU, 0, &flood);
        assert_eq!((outcome.added, outcome.dropped), (5, 95));
        assert_eq!(index.store(slot(1), GPU, 0, &[1, 2, 3]).added, 3);
        assert_eq!(index.longest_prefixes(GPU, 0, &[1, 2, 3]).get(1), 3);
        assert_eq!(
            (index.slot_entries(slot(0)), index.slot_entries(slot(1))),
            (5, 3)
        );
        index.remove(slot(0), GPU, 0, &[100]);
        assert_eq!(index.slot_entries(slot(0)), 4);
        assert_eq!(index.purge(slot(1)), 3);
        assert_eq!(index.slot_entries(slot(1)), 0);
        index.share_among(1);
        assert_eq!(index.store(slot(0), GPU, 0, &flood).added, 6);
    }

    #[test]
    fn a_block_stays_held_until_its_last_copy_is_removed() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), GPU, 1, &[1, 2]);
        index.store(slot(0), GPU, 1, &[1]);
        assert_eq!(index.entries(), 2);
        assert_eq!(index.remove(slot(0), GPU, 1, &[1]), 0);
        assert_eq!(index.longest_prefixes(GPU, 1, &[1, 2]).get(0), 2);
        assert_eq!(index.remove(slot(0), GPU, 1, &[1]), 1);
        assert_eq!(index.longest_prefixes(GPU, 1, &[1, 2]).get(0), 0);
        index.store(slot(0), GPU, 1, &[2]);
        index.purge(slot(0));
        index.store(slot(0), GPU, 1, &[2]);
        assert_eq!(
            index.remove(slot(0), GPU, 1, &[2]),
            1,
            "a purge forgets copies"
        );
    }

    #[test]
    fn groups_are_kept_apart() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), GPU, 1, &[1, 2]);
        assert_eq!(index.longest_prefixes(GPU, 0, &[1, 2]).get(0), 0);
        assert_eq!(index.remove(slot(0), GPU, 0, &[1]), 0);
        assert_eq!(index.longest_prefixes(GPU, 1, &[1, 2]).get(0), 2);
    }

    #[test]
    fn agrees_with_a_naive_model_on_random_operations() {
        use std::collections::HashMap;
        let mut index = PrefixIndex::new(usize::MAX);
        // Slots packed as a bitmask, as a list and spilled to a bitmap.
        let slots = [0, 1, 61, 62, 63, 64, 700, 1023].map(slot);
        // Per slot: copies held of each (group, key).
        let mut model: Vec<HashMap<(Group, u64), u32>> = vec![HashMap::new(); slots.len()];
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            state >> 33
        };
        for _ in 0..10_000 {
            let s = (next() % slots.len() as u64) as usize;
            let group = (next() % 2) as Group;
            let keys: Vec<u64> = (0..(next() % 6)).map(|_| next() % 20).collect();
            match next() % 10 {
                0 => {
                    index.purge(slots[s]);
                    model[s].clear();
                }
                1..=4 => {
                    index.remove(slots[s], GPU, group, &keys);
                    for k in &keys {
                        if let Some(n) = model[s].get_mut(&(group, *k)) {
                            *n -= 1;
                            if *n == 0 {
                                model[s].remove(&(group, *k));
                            }
                        }
                    }
                }
                _ => {
                    index.store(slots[s], GPU, group, &keys);
                    for k in &keys {
                        *model[s].entry((group, *k)).or_default() += 1;
                    }
                }
            }
            let query: Vec<u64> = (0..(next() % 8)).map(|_| next() % 20).collect();
            let got = index.longest_prefixes(GPU, group, &query);
            for (s, held) in slots.iter().zip(&model) {
                let want = query
                    .iter()
                    .take_while(|k| held.contains_key(&(group, **k)))
                    .count() as u32;
                assert_eq!(got.get(s.index()), want);
                if let Some(k) = query.first() {
                    assert_eq!(
                        index.holds(GPU, group, *k, *s),
                        held.contains_key(&(group, *k))
                    );
                }
            }
            assert_eq!(
                index.entries(),
                model.iter().map(|m| m.len()).sum::<usize>()
            );
            for (s, held) in slots.iter().zip(&model) {
                assert_eq!(index.slot_entries(*s), held.len());
            }
        }
    }
}
