//! The prefix index: which endpoint slots hold which block keys, per storage tier.
//!
//! One hash map per tier from block key to a 64-bit set of endpoint slots. Block keys are
//! truncated SHA-256 or XXH3 digests, so they spread evenly under a cheap hasher. Memory per
//! key is one 16-byte entry plus hashbrown's control byte and load-factor slack, shared by
//! every endpoint holding the block (figures in `docs/benchmarks/daemon.md`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::RandomState;

/// Endpoint slots per index: one bit each in a block's holder set.
pub const MAX_SLOTS: usize = 64;

/// The tier vLLM's own GPU block pool reports, and the one lookups rank on.
pub const GPU: &str = "GPU";

/// An endpoint's position in the holder sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u8);

impl Slot {
    /// The slot numbered `n`, if within [`MAX_SLOTS`].
    pub fn new(n: usize) -> Option<Self> {
        (n < MAX_SLOTS).then_some(Self(n as u8))
    }

    /// Its number.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn bit(self) -> u64 {
        1u64 << self.0
    }
}

type Holders = HashMap<u64, u64, RandomState>;

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
    tiers: HashMap<String, Holders>,
    entries: usize,
    max_entries: usize,
    /// Entries held per slot.
    by_slot: [usize; MAX_SLOTS],
    /// The most one slot may hold: `max_entries` over the slots in use.
    share: usize,
}

impl PrefixIndex {
    /// An empty index that holds at most `max_entries` (block, slot) pairs.
    pub fn new(max_entries: usize) -> Self {
        Self {
            tiers: HashMap::new(),
            entries: 0,
            max_entries,
            by_slot: [0; MAX_SLOTS],
            share: max_entries,
        }
    }

    /// `slots` endpoints share the index from now on: each may hold at most its part of
    /// the bound. A slot already over its new share keeps what it holds and adds nothing
    /// until it is under it again.
    pub fn share_among(&mut self, slots: usize) {
        self.share = self.max_entries / slots.max(1);
    }

    /// Records that `slot` holds `keys` in `medium`.
    pub fn store(&mut self, slot: Slot, medium: &str, keys: &[u64]) -> StoreOutcome {
        let holders = match self.tiers.get_mut(medium) {
            Some(h) => h,
            None => self.tiers.entry(medium.to_owned()).or_default(),
        };
        let mut outcome = StoreOutcome::default();
        let Some(held) = self.by_slot.get_mut(slot.index()) else {
            return outcome;
        };
        for &key in keys {
            let full = self.entries >= self.max_entries || *held >= self.share;
            match holders.entry(key) {
                Entry::Occupied(set) if *set.get() & slot.bit() != 0 => continue,
                _ if full => {
                    outcome.dropped += 1;
                    continue;
                }
                Entry::Occupied(mut set) => *set.get_mut() |= slot.bit(),
                Entry::Vacant(set) => {
                    set.insert(slot.bit());
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

    /// Records that `slot` no longer holds `keys` in `medium`; returns pairs removed.
    pub fn remove(&mut self, slot: Slot, medium: &str, keys: &[u64]) -> usize {
        let Some(holders) = self.tiers.get_mut(medium) else {
            return 0;
        };
        let mut removed = 0;
        for key in keys {
            if let Some(set) = holders.get_mut(key) {
                if *set & slot.bit() != 0 {
                    *set &= !slot.bit();
                    removed += 1;
                    if *set == 0 {
                        holders.remove(key);
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
        let mut removed = 0;
        for holders in self.tiers.values_mut() {
            holders.retain(|_, set| {
                if *set & slot.bit() != 0 {
                    *set &= !slot.bit();
                    removed += 1;
                }
                *set != 0
            });
        }
        self.entries -= removed;
        if let Some(held) = self.by_slot.get_mut(slot.index()) {
            *held -= removed;
        }
        removed
    }

    /// For every slot, how many of `keys` it holds contiguously from `keys[0]` in `medium`.
    pub fn longest_prefixes(&self, medium: &str, keys: &[u64]) -> [u32; MAX_SLOTS] {
        longest_prefixes_by(keys.iter().copied(), self.tier(medium))
    }

    /// The `medium` tier's holder sets, for walks that add holders of their own.
    pub fn tier(&self, medium: &str) -> impl Fn(u64) -> u64 + '_ {
        let tier = self.tiers.get(medium);
        move |key| tier.and_then(|h| h.get(&key)).copied().unwrap_or(0)
    }

    /// The tiers that have held blocks.
    pub fn media(&self) -> impl Iterator<Item = &str> {
        self.tiers.keys().map(String::as_str)
    }

    /// (block, slot) pairs held.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Bytes the tables hold: buckets times entry plus control byte (hashbrown's layout).
    pub fn table_bytes(&self) -> usize {
        self.tiers
            .values()
            .map(|h| {
                let buckets = if h.capacity() == 0 {
                    0
                } else {
                    (h.capacity() * 8 / 7).next_power_of_two()
                };
                buckets * (std::mem::size_of::<(u64, u64)>() + 1)
            })
            .sum()
    }
}

/// For every slot, how many of `keys` it holds contiguously from the first, where
/// `holders(key)` is the set of slots holding `key`: the one walk every index (KV events,
/// bookings over them, the approximate history) is asked through. One probe per key,
/// intersecting 64-bit holder sets, stopping when no slot still matches.
pub fn longest_prefixes_by(
    keys: impl IntoIterator<Item = u64>,
    holders: impl Fn(u64) -> u64,
) -> [u32; MAX_SLOTS] {
    let mut matched = [0u32; MAX_SLOTS];
    let mut alive = u64::MAX;
    let mut depth = 0u32;
    for key in keys {
        let here = holders(key) & alive;
        record(&mut matched, alive & !here, depth);
        alive = here;
        if alive == 0 {
            return matched;
        }
        depth += 1;
    }
    record(&mut matched, alive, depth);
    matched
}

/// Sets `matched[slot] = depth` for every slot in `slots`.
fn record(matched: &mut [u32; MAX_SLOTS], mut slots: u64, depth: u32) {
    while slots != 0 {
        let slot = slots.trailing_zeros() as usize;
        if let Some(m) = matched.get_mut(slot) {
            *m = depth;
        }
        slots &= slots - 1;
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
        index.store(slot(0), GPU, &[1, 2, 3]);
        index.store(slot(1), GPU, &[1, 2, 4]);
        index.store(slot(2), GPU, &[2, 3]);
        let m = index.longest_prefixes(GPU, &[1, 2, 3, 9]);
        assert_eq!(&m[..4], &[3, 2, 0, 0]);
        assert_eq!(index.longest_prefixes("CPU", &[1])[0], 0);
        assert_eq!(index.longest_prefixes(GPU, &[])[0], 0);
    }

    #[test]
    fn tiers_are_kept_apart() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), "CPU", &[1, 2]);
        assert_eq!(index.longest_prefixes(GPU, &[1, 2])[0], 0);
        assert_eq!(index.longest_prefixes("CPU", &[1, 2])[0], 2);
    }

    #[test]
    fn removal_and_purge_forget_only_that_slot() {
        let mut index = PrefixIndex::new(100);
        index.store(slot(0), GPU, &[1, 2, 3]);
        index.store(slot(5), GPU, &[1, 2, 3]);
        assert_eq!(index.entries(), 6);
        assert_eq!(index.remove(slot(0), GPU, &[2, 7]), 1);
        assert_eq!(
            &index.longest_prefixes(GPU, &[1, 2, 3])[..6],
            &[1, 0, 0, 0, 0, 3]
        );
        assert_eq!(index.purge(slot(5)), 3);
        assert_eq!(index.entries(), 2);
        assert_eq!(index.longest_prefixes(GPU, &[1])[5], 0);
    }

    #[test]
    fn the_entry_limit_drops_new_pairs_and_counts_them() {
        let mut index = PrefixIndex::new(3);
        let outcome = index.store(slot(0), GPU, &[1, 2, 3, 4]);
        assert_eq!(
            outcome,
            StoreOutcome {
                added: 3,
                dropped: 1
            }
        );
        assert_eq!(index.store(slot(1), GPU, &[1]).dropped, 1);
        index.remove(slot(0), GPU, &[3]);
        assert_eq!(index.store(slot(1), GPU, &[1]).added, 1);
    }

    #[test]
    fn a_slot_holds_at_most_its_share_and_the_others_keep_room() {
        let mut index = PrefixIndex::new(10);
        index.share_among(2);
        let flood: Vec<u64> = (100..200).collect();
        let outcome = index.store(slot(0), GPU, &flood);
        assert_eq!((outcome.added, outcome.dropped), (5, 95));
        assert_eq!(index.store(slot(1), GPU, &[1, 2, 3]).added, 3);
        assert_eq!(index.longest_prefixes(GPU, &[1, 2, 3])[1], 3);
        assert_eq!(
            (index.slot_entries(slot(0)), index.slot_entries(slot(1))),
            (5, 3)
        );
        index.remove(slot(0), GPU, &[100]);
        assert_eq!(index.slot_entries(slot(0)), 4);
        assert_eq!(index.purge(slot(1)), 3);
        assert_eq!(index.slot_entries(slot(1)), 0);
        index.share_among(1);
        assert_eq!(index.store(slot(0), GPU, &flood).added, 6);
    }

    #[test]
    fn agrees_with_a_naive_model_on_random_operations() {
        let mut index = PrefixIndex::new(usize::MAX);
        let mut model: Vec<std::collections::HashSet<u64>> = vec![Default::default(); 4];
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            state >> 33
        };
        for _ in 0..5000 {
            let s = (next() % 4) as usize;
            let keys: Vec<u64> = (0..(next() % 6)).map(|_| next() % 20).collect();
            match next() % 10 {
                0 => {
                    index.purge(slot(s));
                    model[s].clear();
                }
                1..=3 => {
                    index.remove(slot(s), GPU, &keys);
                    keys.iter().for_each(|k| {
                        model[s].remove(k);
                    });
                }
                _ => {
                    index.store(slot(s), GPU, &keys);
                    model[s].extend(&keys);
                }
            }
            let query: Vec<u64> = (0..(next() % 8)).map(|_| next() % 20).collect();
            let got = index.longest_prefixes(GPU, &query);
            for (slot_n, held) in model.iter().enumerate() {
                let want = query.iter().take_while(|k| held.contains(k)).count() as u32;
                assert_eq!(got[slot_n], want);
            }
            assert_eq!(
                index.entries(),
                model.iter().map(|m| m.len()).sum::<usize>()
            );
            for (n, held) in model.iter().enumerate() {
                assert_eq!(index.slot_entries(slot(n)), held.len());
            }
        }
    }
}
