//! Which salts each replica holds a first block of, from its KV events. vLLM keys a
//! request's `cache_salt` into block 0 only and publishes it in that block's extra keys,
//! so a salt no replica holds a first block of cannot match a cached prefix anywhere: the
//! filter may route such a request by load without tokenizing it.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::RandomState;

use crate::slots::{Slot, SlotSet};

/// First blocks tracked per daemon; past it a replica's further salts are unknowable, and
/// it counts as holding every salt (a probe then tokenizes, as without this index).
pub const MAX_SALTED_ROOTS: usize = 1 << 20;

/// The salts of the first blocks each slot holds.
#[derive(Debug, Default)]
pub struct SaltIndex {
    /// (slot, first block's key) -> the salt tags its extra keys carry, and the copies
    /// stored (one per group and tier).
    roots: HashMap<(Slot, u64), (Vec<u64>, u32), RandomState>,
    /// Salt tag -> (slot, first blocks of it the slot holds), only slots holding some: a
    /// salt is on one replica or a few, and a count per possible slot would cost kilobytes
    /// for each of what may be millions of salts.
    held: HashMap<u64, Vec<(Slot, u32)>, RandomState>,
    /// Slots whose salts cannot be known: a first block published without extra keys
    /// (vLLM before 0.17) or past [`MAX_SALTED_ROOTS`].
    unknown: SlotSet,
}

impl SaltIndex {
    /// `slot` stored the first block `root`, its extra keys carrying `tags` (every string
    /// but the LoRA name: a multimodal hash taken for a salt only costs a tokenizer call),
    /// or None when the event had no extra keys at all.
    pub fn stored(&mut self, slot: Slot, root: u64, tags: Option<Vec<u64>>) {
        let Some(tags) = tags else {
            self.unknown.insert(slot);
            return;
        };
        if tags.is_empty() {
            return;
        }
        let full = self.roots.len() >= MAX_SALTED_ROOTS;
        match self.roots.entry((slot, root)) {
            Entry::Occupied(mut entry) => entry.get_mut().1 += 1,
            Entry::Vacant(entry) => {
                if full {
                    self.unknown.insert(slot);
                    return;
                }
                for &tag in &tags {
                    let counts = self.held.entry(tag).or_default();
                    match counts.iter_mut().find(|(s, _)| *s == slot) {
                        Some((_, count)) => *count += 1,
                        None => counts.push((slot, 1)),
                    }
                }
                entry.insert((tags, 1));
            }
        }
    }

    /// `slot` dropped one copy of the block `key` (any block: most are not first blocks).
    pub fn removed(&mut self, slot: Slot, key: u64) {
        let Entry::Occupied(mut entry) = self.roots.entry((slot, key)) else {
            return;
        };
        entry.get_mut().1 -= 1;
        if entry.get().1 > 0 {
            return;
        }
        let (tags, _) = entry.remove();
        for tag in tags {
            self.release(tag, slot);
        }
    }

    /// `slot` holds nothing any more (purged, cleared or removed).
    pub fn purge(&mut self, slot: Slot) {
        let mut released = Vec::new();
        self.roots.retain(|(s, _), (tags, _)| {
            if *s == slot {
                released.append(tags);
            }
            *s != slot
        });
        for tag in released {
            self.release(tag, slot);
        }
        self.unknown.remove(slot);
    }

    fn release(&mut self, tag: u64, slot: Slot) {
        if let Entry::Occupied(mut held) = self.held.entry(tag) {
            let counts = held.get_mut();
            if let Some(i) = counts.iter().position(|(s, _)| *s == slot) {
                if let Some((_, count)) = counts.get_mut(i) {
                    *count -= 1;
                    if *count == 0 {
                        counts.swap_remove(i);
                    }
                }
            }
            if counts.is_empty() {
                held.remove();
            }
        }
    }

    /// Whether `slot` holds, or may hold, a first block of salt `tag`.
    pub fn may_hold(&self, tag: u64, slot: Slot) -> bool {
        self.unknown.contains(slot)
            || self
                .held
                .get(&tag)
                .is_some_and(|counts| counts.iter().any(|(s, _)| *s == slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: usize) -> Slot {
        Slot::new(n).unwrap()
    }

    /// The slots of `0..MAX_SLOTS` that may hold `tag`.
    fn holders(salts: &SaltIndex, tag: u64) -> Vec<usize> {
        (0..crate::slots::MAX_SLOTS)
            .filter(|n| salts.may_hold(tag, slot(*n)))
            .collect()
    }

    #[test]
    fn a_salt_is_held_while_a_first_block_of_it_is() {
        let mut salts = SaltIndex::default();
        let (a, b) = (slot(0), slot(700));
        salts.stored(a, 10, Some(vec![7]));
        // The same block in a second group: two copies.
        salts.stored(a, 10, Some(vec![7]));
        salts.stored(b, 11, Some(vec![7, 8]));
        salts.stored(b, 12, Some(Vec::new()));
        assert_eq!(holders(&salts, 7), [0, 700]);
        assert_eq!(holders(&salts, 8), [700]);
        assert!(holders(&salts, 9).is_empty());
        salts.removed(a, 10);
        assert_eq!(holders(&salts, 7), [0, 700]);
        salts.removed(a, 10);
        salts.removed(a, 99);
        assert_eq!(holders(&salts, 7), [700]);
        salts.purge(b);
        assert!(holders(&salts, 7).is_empty() && holders(&salts, 8).is_empty());
        assert!(salts.roots.is_empty() && salts.held.is_empty());
    }

    #[test]
    fn a_replica_whose_salts_cannot_be_known_may_hold_any() {
        let mut salts = SaltIndex::default();
        salts.stored(slot(2), 10, None);
        assert_eq!(holders(&salts, 1), [2]);
        salts.purge(slot(2));
        assert!(holders(&salts, 1).is_empty());
    }
}
